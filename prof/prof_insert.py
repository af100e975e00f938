"""Profile inserts: K actor processes (same-host insert plane or network path) into one daemon.

Usage: ``PYTHONPATH=.:/tmp/site OUT=/tmp/out python3 prof/prof_insert.py K [net]``.
Prints the aggregate GB/s; with ``SPY=1`` (default) py-spy records the daemon,
one actor and, on the network path, every ingest worker (``GIL=1``: only the
thread holding the GIL).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "prof")]

import bench_scale as bs
from pyspy import spy

OUT = os.environ.get("OUT", "/tmp/out")


def children(pid: int) -> list[int]:
    """Direct child pids of ``pid`` (the daemon's ingest workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    network = len(sys.argv) > 2 and sys.argv[2] == "net"
    seconds = float(os.environ.get("SECONDS_WINDOW", "6"))
    workers = int(os.environ.get("WORKERS", "8"))
    do_spy = os.environ.get("SPY", "1") == "1"
    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=bs.serve, args=(4096, workers, port_queue, stop))
    server.start()
    address = f"localhost:{port_queue.get(timeout=60)}"
    tag = f"{'net' if network else 'shm'}_k{k}"
    try:
        ready, go, res = ctx.Queue(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=bs.actor, args=(address, network, seconds, ready, go, res)) for _ in range(k)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        spies = []
        if do_spy:
            spies = [spy(server.pid, OUT, f"daemon_{tag}", seconds - 1),
                     spy(procs[0].pid, OUT, f"actor_{tag}", seconds - 1)]
            if network:
                spies += [spy(w, OUT, f"worker{i}_{tag}", seconds - 1) for i, w in enumerate(children(server.pid))]
        workers_pids = children(server.pid)
        watched = {"daemon": [server.pid], "workers": workers_pids, "actors": [p.pid for p in procs]}
        before = {name: [cpu_seconds(pid) for pid in pids] for name, pids in watched.items()}
        busy0, total0 = machine_busy()
        started = time.perf_counter()
        go.set()
        out = [res.get(timeout=seconds + 120) for _ in range(k)]
        wall = time.perf_counter() - started
        busy1, total1 = machine_busy()
        cores = {name: sum(cpu_seconds(pid) - b for pid, b in zip(pids, before[name], strict=True)) / wall
                 for name, pids in watched.items()}
        for s in spies:
            s.wait(60)
        for p in procs:
            p.join(30)
        total = sum(r["items"] for r in out)
        window = max(r["seconds"] for r in out)
        row = {"tag": tag, "gbps": total * bs.ITEM_BYTES / window / 1e9, "items": total,
               "paths": sorted({r["path"] for r in out}),
               "cores_busy": {name: round(v, 2) for name, v in cores.items()},
               "machine_busy": round((busy1 - busy0) / (total1 - total0), 3)}
        print(json.dumps(row), flush=True)
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()


if __name__ == "__main__":
    main()
