"""Data-parallel ranks benchmark: w ranks on one global selection against w independent samplers, and column
projection's bytes moved.

Workload: bench_core's trajectories (64 steps of {obs: float32[1024], action: int64, reward: float32},
256.8 KiB each) in a Uniform table, served by a daemon in its own process. Each rank is a process of its
own (as one process per GPU), with its own PlaneSampler over shm into host memory (``--device cuda``: into
GPU memory, rank r on GPU r mod the GPUs present), taking ``--steps`` batches of B items:

* independent  w samplers each sampling on its own (what four learners do without groups)
* grouped      PlaneSampler(rank=r, world_size=w, seed=s): every step's w B picks made once by the daemon,
               each rank leasing and reading its B rows
* ceiling      the same w processes copying B random rows of the same size out of a /dev/shm mapping
               (``--device cuda``: one pinned host-to-device copy of B rows per step, every rank's GPU at
               once: the aggregate PCIe ceiling), measured in the same run
* columns      grouped ranks with columns=["action", "reward"] against all fields: bytes moved per batch
               (counted by the plane) and GB/s of the bytes moved

Figures are aggregate GB/s of item payload over all ranks (total bytes / wall time from the first rank's
start to the last rank's end), the best of ``--repeats`` interleaved runs. Goal: grouped >= 0.8 x independent
(one selection shared costs little).

Usage: python bench/bench_ranks.py [--world 2] [--batch 32] [--steps 100] [--items 1024] [--repeats 3]
                                   [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_core  # noqa: E402 - the core workload and its server

ITEM_BYTES = bench_core.ITEM_BYTES
GOAL_GROUPED_VS_INDEPENDENT = 0.8
GOAL_GROUPED_VS_CEILING = 0.9  # into GPU memory: ranks on one selection against the GPUs' aggregate PCIe ceiling
SEED = 1234


def _rank(mode: str, address: str, rank: int, world: int, batch: int, steps: int, device: str | None,
          columns: list[str] | None, barrier, results) -> None:
    """One rank: ``steps`` batches of ``batch`` items (or the ceiling's copies); reports its clock and bytes."""
    if device == "cuda":
        import cupy as cp

        gpu = rank % cp.cuda.runtime.getDeviceCount()
        cp.cuda.Device(gpu).use()
        device = f"cuda:{gpu}"
    if mode == "ceiling":
        _ceiling_rank(rank, batch, steps, device, barrier, results)
        return
    from gear_client.data_planes.sampler import PlaneSampler

    group = {"rank": rank, "world_size": world, "seed": SEED, "group_id": f"bench-{mode}"} if mode != "independent" \
        else {}
    with PlaneSampler(address, "uniform", planes=["shm"], device=device, columns=columns, **group) as sampler:
        sampler.sample(batch)  # negotiation, mapping, first touch (a step of its own in a group: every rank does it)
        moved_before = sampler.bytes_moved
        payload = 0
        barrier.wait()
        start = time.time()
        for _ in range(steps):
            b = sampler.sample(batch)
            payload += sum(int(np.prod(c.shape)) * c.dtype.itemsize for c in b.columns)
        if device is not None:
            import cupy as cp

            cp.cuda.get_current_stream().synchronize()
        end = time.time()
        results.put((rank, start, end, payload, sampler.bytes_moved - moved_before))


def _ceiling_rank(rank: int, batch: int, steps: int, device: str | None, barrier, results) -> None:
    """B random rows of ITEM_BYTES out of a /dev/shm mapping per step (into GPU memory with a device)."""
    rows = 256  # 64 MiB: well past the caches, without doubling the machine's memory use per rank
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(rows * ITEM_BYTES)
        mapping = mmap.mmap(f.fileno(), rows * ITEM_BYTES)
        src = np.frombuffer(mapping, np.uint8).reshape(rows, ITEM_BYTES)
        src[:] = 1  # first touch before the clock
        rng = np.random.default_rng(rank)
        picks = [rng.integers(0, rows, batch) for _ in range(steps)]
        if device is None:
            out = np.empty((batch, ITEM_BYTES), np.uint8)

            def copy(p):
                for i, row in enumerate(p.tolist()):  # one memcpy per item, as the shm plane copies large items
                    out[i] = src[row]
        else:
            import cupy as cp

            pinned = cp.cuda.alloc_pinned_memory(batch * ITEM_BYTES)
            host = np.frombuffer(pinned, np.uint8, batch * ITEM_BYTES).reshape(batch, ITEM_BYTES)
            dev = cp.empty((batch, ITEM_BYTES), cp.uint8)

            host[:] = 1

            def copy(p):  # the PCIe ceiling: one pinned host-to-device copy of B rows, all ranks at once
                dev.set(host)
        copy(picks[0])
        barrier.wait()
        start = time.time()
        for p in picks:
            copy(p)
        if device is not None:
            import cupy as cp

            cp.cuda.get_current_stream().synchronize()
        end = time.time()
    results.put((rank, start, end, steps * batch * ITEM_BYTES, steps * batch * ITEM_BYTES))


def run_ranks(ctx, mode: str, address: str, world: int, batch: int, steps: int, device: str | None,
              columns: list[str] | None = None) -> dict[str, float]:
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(mode, address, r, world, batch, steps, device, columns, barrier,
                                              results)) for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    start, end = min(g[1] for g in got), max(g[2] for g in got)
    payload, moved = sum(g[3] for g in got), sum(g[4] for g in got)
    return {"gbps": payload / (end - start) / 1e9, "seconds": end - start, "payload_bytes": payload,
            "moved_bytes": moved, "moved_per_batch": moved / (world * steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--items", type=int, default=1024)
    parser.add_argument("--device", choices=["cuda"], default=None)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved; the best is kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=bench_core._serve, args=("gear", args.items, port_queue, stop_event), daemon=True)
    server.start()
    try:
        address = f"localhost:{port_queue.get(timeout=180)}"
        client = bench_core.connect(bench_core.import_backend("gear"), address, bench_core.NETWORK_PLANES)
        bench_core.write_items(client, "uniform", args.items, bench_core._trajectories(8))
        common = (address, args.world, args.batch, args.steps, args.device)
        figures: dict[str, Any] = {}
        for _ in range(args.repeats):  # interleaved, best of each: a busy machine slows some runs
            for name, mode, columns in (("ceiling", "ceiling", None), ("independent", "independent", None),
                                        ("grouped", "grouped", None),
                                        ("grouped_columns", "grouped-columns", ["action", "reward"])):
                got = run_ranks(ctx, mode, *common, columns=columns)
                if name not in figures or got["gbps"] > figures[name]["gbps"]:
                    figures[name] = got
    finally:
        stop_event.set()
        server.join(30)
        if server.is_alive():
            server.kill()
    where = "GPU memory" if args.device else "host memory"
    print(f"bench_ranks: {args.world} ranks (processes), B={args.batch} per rank, {args.steps} steps, best of "
          f"{args.repeats}, "
          f"{args.items} items of {ITEM_BYTES / 1024:.1f} KiB, shm into {where}; {bench_core.machine()}")
    ceiling = figures["ceiling"]["gbps"]
    for name in ("ceiling", "independent", "grouped"):
        f = figures[name]
        print(f"  {name:<12} {f['gbps']:7.2f} GB/s aggregate  ({f['gbps'] / ceiling:5.0%} of the ceiling, "
              f"{f['seconds']:.2f} s)")
    ratio = figures["grouped"]["gbps"] / figures["independent"]["gbps"]
    print(f"  grouped / independent: {ratio:.2f} (goal >= {GOAL_GROUPED_VS_INDEPENDENT:g}: "
          f"{'met' if ratio >= GOAL_GROUPED_VS_INDEPENDENT else 'missed'})")
    if args.device:
        share_of_ceiling = figures["grouped"]["gbps"] / ceiling
        print(f"  grouped / aggregate ceiling: {share_of_ceiling:.2f} (goal >= {GOAL_GROUPED_VS_CEILING:g}: "
              f"{'met' if share_of_ceiling >= GOAL_GROUPED_VS_CEILING else 'missed'})")
    full, cols = figures["grouped"], figures["grouped_columns"]
    share = cols["moved_per_batch"] / full["moved_per_batch"]
    print(f"  columns=['action', 'reward']: {cols['moved_per_batch'] / 1024:.1f} KiB moved per batch against "
          f"{full['moved_per_batch'] / 1024:.1f} KiB for all fields ({share:.2%}); "
          f"{cols['gbps']:.3f} GB/s of the wanted bytes")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "figures": figures},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
