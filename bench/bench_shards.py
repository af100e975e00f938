"""Sharding benchmark: one table over 1, 2 and 4 daemons on this host (issue 11).

Every daemon is its own ``gear-server`` process with its own shm segments; the
client sees them as one table (``reverb.Client([a, b, ...])``). Figures:

* insert   same-host actors (one process each, ``--actors-per-shard`` per daemon) write
           the core workload's trajectories (64 steps of obs float32[1024], 256.8 KiB)
           through a ShardedClient: each actor's writers go to the daemons in turn, so
           the load spreads. Aggregate GB/s; goal >= 0.8 x N x the one-daemon figure.
* pull     one learner's TrajectoryDataset over all daemons, B items per batch, each
           shard's part over its best plane (shm here; ``--planes inline`` forces gRPC),
           into GPU memory with ``--device cuda``. GB/s of item payload; goal on the GPU
           machine >= 0.9 x the PCIe ceiling (55 GB/s pinned H2D) however many shards.
           With inline collection on a small machine, the per-shard overhead: ms per batch
           against one daemon.
* select   prioritized selection of 4096 over 4 shards of ``--prio-items`` one-step items
           each, end to end (masses asked, batch split, each shard selects its part, the
           parts' 8-byte items collected and assembled). Goal: under 100 us at 1M items.

Usage: python bench/bench_shards.py [--full] [--device cuda] [--json PATH]
(``make bench-shards``: small, CPU, inline collection; ``make bench-shards-gpu``: full, on the GPU machine,
each shard over its best plane: shm here.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_core  # noqa: E402 - the core workload (trajectories, writer loop)

ITEM_BYTES = bench_core.ITEM_BYTES
PCIE_GBPS = 55.6  # pinned host-to-device copy, H200 machine (ARCHITECTURE.md)
GOALS = {"insert_scaling": 0.8, "pull_vs_pcie": 0.9, "select_us": 100.0}
SELECT_BATCH = 4096
SELECT_SHARDS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int, instance: str, max_size: int, prio_items: int) -> str:
    return f'''
bind_address = "127.0.0.1"
port = {port}
instance_name = "{instance}"

[[tables]]
name = "t"
sampler = "uniform"
remover = "fifo"
max_size = {max_size}
rate_limiter = {{ min_size = 1 }}

[[tables]]
name = "p"
sampler = {{ prioritized = {{ priority_exponent = 0.6 }} }}
remover = "fifo"
max_size = {max(prio_items, 1)}
rate_limiter = {{ min_size = 1 }}

[logging]
level = "WARNING"
'''


class Daemons:
    """N gear-server processes on loopback (each its own shm segments)."""

    def __init__(self, n: int, folder: Path, max_size: int, prio_items: int):
        self.procs = []
        self.addresses = []
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for i in range(n):
            port = _free_port()
            path = folder / f"shard{i}.toml"
            path.write_text(_config(port, f"benchshard{os.getpid()}n{n}s{i}", max_size, prio_items))
            log = open(folder / f"shard{i}.log", "wb")  # noqa: SIM115 - closed with the process
            self.procs.append((subprocess.Popen([sys.executable, "-m", "gear_server", "--config", str(path)],
                                                stdout=log, stderr=log, env=env), log))
            self.addresses.append(f"127.0.0.1:{port}")
        import gear_client as reverb

        for address, (proc, _) in zip(self.addresses, self.procs, strict=True):
            host, port = address.rsplit(":", 1)
            deadline = time.monotonic() + 60
            while True:  # the port first (quietly), then one call
                if proc.poll() is not None:
                    raise RuntimeError(f"gear-server for {address} exited ({proc.returncode}); see {folder}")
                try:
                    socket.create_connection((host, int(port)), timeout=1.0).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            reverb.Client(address).server_info(timeout=30.0)

    def stop(self) -> None:
        for proc, _log in self.procs:
            proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


# ---------------------------------------------------------------- inserts --

def _actor(addresses: list[str], writers: int, seconds: float, seed: int, out) -> None:
    import gear_client as reverb

    client = reverb.Client(addresses, seed=seed)
    pool = bench_core._trajectories(4, seed)
    steps = [[{k: tr[k][t] for k in tr} for t in range(bench_core.STEPS)] for tr in pool]
    ws = [client.trajectory_writer(num_keep_alive_refs=bench_core.STEPS) for _ in range(writers)]
    items = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        w = ws[items % len(ws)]
        for step in steps[items % len(steps)]:
            w.append(step)
        w.create_item("t", 1.0, {k: w.history[k][-bench_core.STEPS:] for k in ("obs", "action", "reward")})
        items += 1
    for w in ws:
        w.flush()
        w.close()
    out.put((items, time.perf_counter() - start))


def bench_insert(addresses: list[str], actors: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(addresses, len(addresses), seconds, i, out)) for i in range(actors)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    items = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    return {"items": items, "actors": actors, "gbps": items * ITEM_BYTES / elapsed / 1e9}


# ---------------------------------------------------------------- learner pull --

def bench_pull(addresses: list[str], batch: int, seconds: float, planes: list[str] | None, device: Any
               ) -> dict[str, Any]:
    import gear_client as reverb

    target = addresses if len(addresses) > 1 else addresses[0]
    with reverb.TrajectoryDataset(target, "t", batch_size=batch, planes=planes, device=device) as ds:
        it = ds.batches()
        next(it)  # warm-up: sessions, mappings, first buffers
        items = n = 0
        start = time.perf_counter()
        while n < 3 or time.perf_counter() - start < seconds:
            b = next(it)
            items += len(b)
            n += 1
        if device is not None:
            import cupy as cp

            cp.cuda.runtime.deviceSynchronize()
        elapsed = time.perf_counter() - start
        plane = ds.plane
    return {"gbps": items * ITEM_BYTES / elapsed / 1e9, "ms_per_batch": elapsed / n * 1e3, "plane": plane}


# ---------------------------------------------------------------- selection --

def _fill_prio(address: str, items: int, seed: int) -> None:
    import gear_client as reverb

    rng = np.random.default_rng(seed)
    priorities = rng.uniform(0.1, 10.0, items)
    client = reverb.Client(address)
    with client.trajectory_writer(num_keep_alive_refs=1) as w:
        for i in range(items):
            w.append({"x": np.int64(i)})
            w.create_item("p", float(priorities[i]), {"x": w.history["x"][-1]})
            if i % 4096 == 4095:
                w.flush()


def bench_select(addresses: list[str], items: int, reps: int) -> dict[str, Any]:
    import gear_client as reverb
    from gear_client.sharding import sharded_sampler

    ctx = mp.get_context("spawn")
    fill_start = time.perf_counter()
    procs = [ctx.Process(target=_fill_prio, args=(a, items, i)) for i, a in enumerate(addresses)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    fill_s = time.perf_counter() - fill_start
    client = reverb.Client(addresses)
    sampler = client.sampler("p")
    for _ in range(3):
        sampler.sample(SELECT_BATCH)
    total, weights_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sampler.weights()
        t1 = time.perf_counter()
        batch = sampler.sample(SELECT_BATCH)
        t2 = time.perf_counter()
        assert len(batch) == SELECT_BATCH
        weights_s.append(t1 - t0)
        total.append(t2 - t1)
    kinds = sampler.kinds()
    # the split by masses at most 1 s old: one round trip less per batch
    cached = sharded_sampler(client, "p", client_type=reverb.Client, weights_max_age_s=1.0)
    for _ in range(3):
        cached.sample(SELECT_BATCH)
    cached_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cached.sample(SELECT_BATCH)
        cached_s.append(time.perf_counter() - t0)
    cached.close()
    # read ahead (what a dataset does for this table): batches cut from every shard's stream of picks
    streamed = client.sampler("p").batches(SELECT_BATCH)
    for _ in range(3):
        next(streamed)
    streamed_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        next(streamed)
        streamed_s.append(time.perf_counter() - t0)
    streamed.close()
    client.close()
    return {"items_per_shard": items, "fill_s": fill_s, "us_median": float(np.median(total)) * 1e6,
            "us_p90": float(np.percentile(total, 90)) * 1e6, "mass_query_us": float(np.median(weights_s)) * 1e6,
            "cached_split_us": float(np.median(cached_s)) * 1e6, "streamed_us": float(np.median(streamed_s)) * 1e6,
            "planes": sorted(set(kinds.values()))}


# ---------------------------------------------------------------- driver --

def machine() -> str:
    cores = os.cpu_count()
    gpu = ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        gpu = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{platform.node()}: {cores} cores" + (f", {gpu}" if gpu else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "full": args.full, "device": args.device, "shards": {}}
    planes = None if args.planes is None else args.planes.split(",")
    for n in args.shards:
        with tempfile.TemporaryDirectory(prefix="gear-bench-shards-") as tmp:
            daemons = Daemons(n, Path(tmp), max_size=args.items_per_shard, prio_items=0)
            try:
                r = {"insert": bench_insert(daemons.addresses, n * args.actors_per_shard, args.seconds)}
                r["pull"] = bench_pull(daemons.addresses, args.batch, args.seconds, planes, args.device)
            finally:
                daemons.stop()
        results["shards"][n] = r
        print(f"  {n} daemon(s): insert {r['insert']['gbps']:.3f} GB/s ({r['insert']['actors']} actors), "
              f"pull {r['pull']['gbps']:.3f} GB/s, {r['pull']['ms_per_batch']:.1f} ms/batch over "
              f"{r['pull']['plane']}", flush=True)
    if args.prio_items > 0:
        with tempfile.TemporaryDirectory(prefix="gear-bench-shards-") as tmp:
            daemons = Daemons(SELECT_SHARDS, Path(tmp), max_size=16, prio_items=args.prio_items)
            try:
                results["select"] = bench_select(daemons.addresses, args.prio_items, args.select_reps)
            finally:
                daemons.stop()
    return results


def print_results(r: dict[str, Any]) -> None:
    print(f"\nsharding benchmark ({r['machine']}; {'full' if r['full'] else 'small'}, device={r['device']})")
    one = r["shards"].get(1)
    print(f"{'daemons':>8} {'insert GB/s':>12} {'x one':>7} {'goal':>6} {'pull GB/s':>10} {'ms/batch':>9} "
          f"{'+ms/shard':>10}  plane")
    for n, s in r["shards"].items():
        ins, pull = s["insert"]["gbps"], s["pull"]
        ratio = ins / one["insert"]["gbps"] if one else float("nan")
        extra = (pull["ms_per_batch"] - one["pull"]["ms_per_batch"]) / (n - 1) if one and n > 1 else 0.0
        goal = GOALS["insert_scaling"] * n
        print(f"{n:>8} {ins:>12.3f} {ratio:>7.2f} {goal:>6.1f} {pull['gbps']:>10.3f} {pull['ms_per_batch']:>9.2f} "
              f"{extra:>10.2f}  {pull['plane']}")
    if r["device"]:
        best = min(s["pull"]["gbps"] for s in r["shards"].values())
        print(f"learner pull, worst over shard counts: {best:.1f} GB/s = {best / PCIE_GBPS:.2f} x PCIe "
              f"{PCIE_GBPS} GB/s (goal >= {GOALS['pull_vs_pcie']})")
    sel = r.get("select")
    if sel:
        print(f"prioritized select {SELECT_BATCH} over {SELECT_SHARDS} shards of {sel['items_per_shard']} items: "
              f"{sel['us_median']:.0f} us median, {sel['us_p90']:.0f} us p90 (goal < {GOALS['select_us']:.0f} us; "
              f"mass query alone {sel['mass_query_us']:.0f} us; split by masses <= 1 s old: "
              f"{sel['cached_split_us']:.0f} us; read ahead from the shards' streams: {sel['streamed_us']:.0f} us "
              f"a batch; planes {'+'.join(sel['planes'])}; "
              f"fill {sel['fill_s']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the GPU machine's sizes (B=256, 1M items per shard)")
    parser.add_argument("--device", default=None, help='"cuda": learner batches in GPU memory')
    parser.add_argument("--planes", default=None,
                        help='e.g. "inline" (default: inline when small, the best plane per shard with --full)')
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--actors-per-shard", type=int, default=None)
    parser.add_argument("--items-per-shard", type=int, default=None, help="table size per daemon (inserts, pull)")
    parser.add_argument("--prio-items", type=int, default=None, help="items per shard of the selection figure")
    parser.add_argument("--select-reps", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    full = args.full
    args.batch = args.batch or (256 if full else 32)
    args.seconds = args.seconds or (5.0 if full else 2.0)
    args.actors_per_shard = args.actors_per_shard or (2 if full else 1)
    args.items_per_shard = args.items_per_shard or (2048 if full else 256)
    args.prio_items = args.prio_items if args.prio_items is not None else (1_000_000 if full else 20_000)
    if args.planes is None and not full:
        args.planes = "inline"  # small: every shard's part over gRPC, to show what each shard adds
    r = run(args)
    print_results(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
