"""Profile the mixed load: K same-host actors inserting while a learner pulls B=256 into GPU memory.

Usage (GPU machine): ``PYTHONPATH=.:/tmp/site OUT=/tmp/out python3 prof/prof_mixed.py K [SWITCH]``.
Prints the learner's GB/s and next() latencies, a ServerInfo probe's latencies and the
actors' GB/s, alone (K=0) and with K actors; with ``SPY=1`` (default) py-spy records the
daemon, the learner and one actor. ``PREFETCH`` / ``BPS``: the learner's Selects in flight
and batches per Select; ``SWITCH``: the daemon's ``sys.setswitchinterval``.
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
import numpy as np
from pyspy import spy

OUT = os.environ.get("OUT", "/tmp/out")


def learner(address, seconds, device, ready, go, results):
    """bench_scale's learner with the pipeline's ``PREFETCH`` and ``BPS`` (batches per Select) from the environment."""
    bs.learner(address, seconds, device, ready, go, results, prefetch=int(os.environ.get("PREFETCH", "2")),
               batches_per_select=int(os.environ["BPS"]) if os.environ.get("BPS") else None)


def probe(address, seconds, go, results):
    import gear_client as reverb

    client = reverb.Client(address)
    client.server_info()
    go.wait()
    lat = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        client.server_info()
        lat.append(time.perf_counter() - t)
        time.sleep(0.01)
    lat = np.array(lat) * 1e3
    results.put({"server_info_ms_p50": float(np.median(lat)), "p90": float(np.percentile(lat, 90)),
                 "max": float(lat.max())})


def serve_variant(max_size, workers, port_queue, stop, switch):
    if switch:
        sys.setswitchinterval(switch)
    bs.serve(max_size, workers, port_queue, stop)


def main():
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    switch = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    do_spy = os.environ.get("SPY", "1") == "1"
    seconds = 8.0
    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve_variant, args=(4096, 8, port_queue, stop, switch))
    server.start()
    address = f"localhost:{port_queue.get(timeout=60)}"
    out = {}
    try:
        print("prefill", bs.run_round(ctx, address, 2, False, 2.0)["items"], flush=True)
        for kk in (0, k):
            ready, go, res, lres, pres = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Queue()
            procs = [ctx.Process(target=bs.actor, args=(address, False, seconds, ready, go, res)) for _ in range(kk)]
            lp = ctx.Process(target=learner, args=(address, seconds, "cuda", ready, go, lres))
            pp = ctx.Process(target=probe, args=(address, seconds, go, pres))
            for p in (*procs, lp, pp):
                p.start()
            for _ in range(kk + 1):
                ready.get(timeout=120)
            spies = []
            if kk and do_spy:
                spies = [spy(server.pid, OUT, f"daemon_k{kk}", seconds - 1),
                         spy(lp.pid, OUT, f"learner_k{kk}", seconds - 1),
                         spy(procs[0].pid, OUT, f"actor_k{kk}", seconds - 1)]
            go.set()
            acts = [res.get(timeout=seconds + 120) for _ in range(kk)]
            row = {"learner": lres.get(timeout=seconds + 120), "probe": pres.get(timeout=seconds + 60),
                   "actor_gbps": sum(a["items"] for a in acts) * bs.ITEM_BYTES / seconds / 1e9}
            for s in spies:
                s.wait(60)
            for p in (*procs, lp, pp):
                p.join(30)
            out[kk] = row
            print(kk, json.dumps(row), flush=True)
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()
    with open(f"{OUT}/mixed_{k}_{switch}.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
