"""Profile a daemon's answer to Selects of many prioritized picks (a sharded learner's selection read ahead).

One ``gear-server`` process (bench_shards.Daemons) with a prioritized table
(exponent 0.6) of N one-step items (bench_shards._fill_prio); then, per path
(gRPC, and the local lane where the daemon offers it) and per k, Select round
trips of k picks, nothing collected, one at a time, each ending the previous
one's lease as a read-ahead stream does. Figures per (path, k): the round trip
(median, p90) and the daemon's CPU per Select (utime + stime of all its threads
from /proc over the timed Selects, divided by their count). ``--updates``: each Select
is followed by new priorities for its keys (MutatePriorities), a learner's step: the
figures are then per step, and the next Select picks from the changed weights.

Usage: ``.venv/bin/python prof/prof_select.py [--items 100000] [--picks 1024 8192]
[--reps 300] [--rounds 1] [--paths grpc lane] [--updates] [--spy [--native]] [--json PATH]``.
``--spy``: py-spy records the daemon during one more run of each (path, k) (raw
folded stacks under ``OUT``, default /tmp/out; ``GIL=1``: the GIL holder only;
``--native``: C frames too, e.g. grpc's and uvloop's work on the event loop).
A/B against another tree: run its copy of this file from that tree's root (the
daemon is started with ``python -m gear_server``, which imports from the current
directory first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "prof")]
os.environ.setdefault("PYSPY", os.path.join(os.path.dirname(sys.executable), "py-spy"))

import bench_shards as bsh
import numpy as np
from prof_insert import cpu_seconds
from pyspy import spy

TABLE = "p"


def spy_native(pid: int, out_dir: str, name: str, seconds: float) -> subprocess.Popen:
    """py-spy over ``pid`` with C frames (busy samples only): what the loop's own time is."""
    log = open(os.path.join(out_dir, f"{name}.log"), "w")  # noqa: SIM115 - handed to the child
    return subprocess.Popen([os.environ["PYSPY"], "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", "250",
                             "-f", "raw", "-t", "--native", "-o", os.path.join(out_dir, f"{name}.txt")],
                            stdout=log, stderr=subprocess.STDOUT)


def open_session(address: str, lane: bool) -> tuple[Any, Any]:
    """(PlaneSession, what to close) of a shm session on ``TABLE``: its Selects over the local lane or gRPC."""
    from gear_client.data_planes.session import PlaneSession
    from gear_client.data_planes.targets import connect
    from gear_contract import negotiation
    from gear_contract._proto import replay_pb2 as pb

    stub, _, channel, daemon = connect(address)
    offer = negotiation.build_offer([negotiation.SHM], negotiation.local_host_id(), None)
    response = stub.OpenDataPlane(pb.OpenDataPlaneRequest(table=TABLE, offer=offer), timeout=30)
    if response.kind != negotiation.SHM:
        raise RuntimeError(f"{address} offered {response.kind!r}, not shm")
    session = PlaneSession(stub, TABLE, response, daemon=daemon if lane else None)
    if lane and (daemon is None or daemon.local_lane() is None):
        raise RuntimeError("the daemon offers no local lane here")
    return session, channel


def time_selects(session: Any, k: int, reps: int, pid: int, client: Any = None) -> dict[str, float]:
    """``reps`` Select round trips of ``k`` picks after a warm-up: round-trip percentiles, daemon CPU per Select.

    ``client``: after each Select, new priorities for its keys (MutatePriorities, timed with it), as a
    learner sends them; the daemon's next Select then picks from the changed weights.
    """
    release: list[int] = []
    gen = np.random.default_rng(k)

    def one() -> None:
        selection = session.select(k, None, None, release)
        assert len(selection) == k, (len(selection), k)
        release[:] = [selection.lease_id]
        if client is not None:
            keys = selection.infos[0].tolist()
            client.mutate_priorities(TABLE, dict(zip(keys, gen.uniform(0.1, 10.0, len(keys)).tolist(), strict=True)))

    for _ in range(max(5, reps // 20)):
        one()
    times = np.empty(reps)
    cpu0 = cpu_seconds(pid)
    t_start = time.perf_counter()
    for i in range(reps):
        t0 = time.perf_counter()
        one()
        times[i] = time.perf_counter() - t0
    wall = time.perf_counter() - t_start
    cpu = cpu_seconds(pid) - cpu0
    session.release(release)
    return {"rt_us_median": float(np.median(times)) * 1e6, "rt_us_p90": float(np.percentile(times, 90)) * 1e6,
            "daemon_cpu_us_per_select": cpu / reps * 1e6, "daemon_busy": cpu / wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--picks", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1, help="times over every (path, k), alternating")
    parser.add_argument("--paths", nargs="+", default=["grpc", "lane"], choices=["grpc", "lane"])
    parser.add_argument("--updates", action="store_true",
                        help="after each Select, MutatePriorities of its keys (a learner's step; timed with it)")
    parser.add_argument("--spy", action="store_true", help="py-spy the daemon over one more run of each")
    parser.add_argument("--native", action="store_true", help="with --spy: C frames too, busy samples only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    out_dir = os.environ.get("OUT", "/tmp/out")
    results: dict[str, Any] = {"items": args.items, "runs": []}
    with tempfile.TemporaryDirectory(prefix="gear-prof-select-") as tmp:
        daemons = bsh.Daemons(1, Path(tmp), max_size=16, prio_items=args.items)
        try:
            address, pid = daemons.addresses[0], daemons.procs[0][0].pid
            t0 = time.perf_counter()
            bsh._fill_prio(address, args.items, 0)
            results["fill_s"] = time.perf_counter() - t0
            print(f"filled {args.items} items in {results['fill_s']:.1f} s", flush=True)
            sessions = {path: open_session(address, path == "lane") for path in args.paths}
            client = None
            if args.updates:
                import gear_client as reverb

                client = reverb.Client(address)
            for _ in range(args.rounds):
                for k in args.picks:
                    for path, (session, _) in sessions.items():
                        row = {"path": path, "k": k, "updates": args.updates,
                               **time_selects(session, k, args.reps, pid, client)}
                        results["runs"].append(row)
                        what = "Select + MutatePriorities" if args.updates else "Select"
                        print(f"  {path:>4} k={k:>5}: round trip {row['rt_us_median']:7.0f} us median "
                              f"({row['rt_us_p90']:.0f} p90), daemon CPU {row['daemon_cpu_us_per_select']:7.0f} us "
                              f"per {what} ({row['daemon_cpu_us_per_select'] / k * 1e3:.0f} ns per pick)",
                              flush=True)
            if args.spy:
                os.makedirs(out_dir, exist_ok=True)
                for k in args.picks:
                    for path, (session, _) in sessions.items():
                        seconds = 4
                        record = spy_native if args.native else spy
                        recorder = record(pid, out_dir, f"select_{path}_k{k}", seconds)
                        time.sleep(0.5)  # py-spy attaches
                        end = time.monotonic() + seconds
                        while time.monotonic() < end:
                            time_selects(session, k, 20, pid, client)
                        recorder.wait(60)
                        print(f"  py-spy: {out_dir}/select_{path}_k{k}.txt", flush=True)
            if client is not None:
                client.close()
            for session, channel in sessions.values():
                session.close()
                if channel is not None:
                    channel.close()
        finally:
            daemons.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
