"""Profile the sharded learner pull: N daemons on this host, B=256 into GPU memory, py-spy on the learner.

Usage (GPU machine): ``PYTHONPATH=.:/tmp/site OUT=/tmp/out python3 prof/prof_pull.py N``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench"), os.path.join(ROOT, "prof")]

import bench_shards as bsh
import numpy as np
from pyspy import spy

OUT = os.environ.get("OUT", "/tmp/out")
SECONDS = 6.0


def fill(address: str, items: int = 600) -> None:
    import gear_client as reverb

    rng = np.random.default_rng(0)
    with reverb.Client(address).trajectory_writer(num_keep_alive_refs=64) as w:
        for _ in range(items):
            for t in range(64):
                w.append({"obs": rng.standard_normal(1024, dtype=np.float32), "action": np.int64(t),
                          "reward": np.float32(t)})
            w.create_item("t", 1.0, {k: w.history[k][-64:] for k in ("obs", "action", "reward")})


def pull(addresses: list[str], seconds: float, results, go) -> None:
    import cupy as cp

    import gear_client as reverb

    ds = reverb.TrajectoryDataset(addresses, "t", batch_size=256, device="cuda")
    batches = ds.batches()
    next(batches)
    results.put(os.getpid())
    go.wait()
    n = 0
    lat = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        next(batches)
        lat.append(time.perf_counter() - t)
        n += 1
    cp.cuda.runtime.deviceSynchronize()
    elapsed = time.perf_counter() - start
    lat = np.array(lat) * 1e3
    results.put({"gbps": n * 256 * bsh.ITEM_BYTES / elapsed / 1e9, "n": n, "p50": float(np.median(lat)),
                 "p90": float(np.percentile(lat, 90)), "plane": ds.plane})
    ds.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        daemons = bsh.Daemons(n, Path(tmp), max_size=2048, prio_items=0)
        try:
            fills = [ctx.Process(target=fill, args=(a,)) for a in daemons.addresses]
            for p in fills:
                p.start()
            for p in fills:
                p.join()
            results, go = ctx.Queue(), ctx.Event()
            learner = ctx.Process(target=pull, args=(daemons.addresses, SECONDS, results, go))
            learner.start()
            pid = results.get(timeout=300)
            spies = [spy(pid, OUT, f"pull{n}_client", SECONDS - 1),
                     spy(daemons.procs[0][0].pid, OUT, f"pull{n}_daemon", SECONDS - 1)]
            go.set()
            result = results.get(timeout=SECONDS + 300)
            for s in spies:
                s.wait(60)
            learner.join(30)
            print(f"pull{n}", json.dumps(result), flush=True)
            with open(f"{OUT}/pull{n}.json", "w") as f:
                json.dump(result, f)
        finally:
            daemons.stop()


if __name__ == "__main__":
    main()
