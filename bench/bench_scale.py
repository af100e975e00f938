"""Scale benchmark: many actor processes inserting, alone and beside a learner (``make bench-scale``).

One daemon (its own process) with one Uniform table and ``[ingest] workers``.
Workload: the core trajectories, 64 steps of {obs: float32[1024], action:
int64, reward: float32} (256.8 KiB), written by actor processes with the
ordinary ``TrajectoryWriter`` (each step appended, one item per 64 steps).

1. Insert scaling: for K actor processes (1, 2, 4, 8, 12), the aggregate insert
   GB/s over a fixed window, twice: *same-host* actors (the insert plane: rows
   copied straight into the table's shared memory) and *network-path* actors
   (``GEAR_INSERT_PLANE=0``: InsertStream to the daemon's ingest workers, which
   write through the insert plane).
2. Mixed load: one learner pulls B=256 batches over the shm plane (into GPU
   memory with ``device="cuda"`` where a GPU exists, else host memory), alone
   (its solo figure) and while K same-host actors insert; its GB/s against solo.

Goals (the 16-core GPU machine): same-host 8 actors >= 6x one actor and >= 2.5
GB/s; network-path 8 actors >= 4x one actor; mixed load with 8 actors: learner
>= 0.85x solo. ``--quick`` runs small (2-core machines): K up to 4, short windows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from typing import Any

import numpy as np

STEPS = 64
OBS_DIM = 1024
ITEM_BYTES = STEPS * (OBS_DIM * 4 + 8 + 4)
BATCH = 256
GOALS = {"same_host_speedup_8": 6.0, "same_host_gbps_8": 2.5, "network_speedup_8": 4.0, "mixed_ratio_8": 0.85}


# ------------------------------------------------------------------ processes ----

def serve(max_size: int, workers: int, port_queue, stop_event) -> None:
    """The daemon process."""
    from gear_contract._proto import replay_pb2 as pb
    from gear_server.config import DaemonSettings
    from gear_server.daemon import Daemon
    from gear_server.ingest.settings import IngestSettings

    table = pb.TableConfig(name="t", max_size=max_size, sampler=pb.SelectorOptions(uniform=True),
                           remover=pb.SelectorOptions(fifo=True),
                           rate_limiter=pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1,
                                                              min_diff=-1e300, max_diff=1e300))
    settings = DaemonSettings.from_server_config(pb.ServerConfig(port=0, bind_address="localhost", tables=[table]))
    settings.ingest = IngestSettings(workers=workers)
    daemon = Daemon(settings)
    port_queue.put(daemon.start())
    stop_event.wait()
    daemon.stop()


def actor(address: str, network: bool, seconds: float, ready, go, results) -> None:
    """Write trajectories for ``seconds`` after ``go``; report (items, seconds, path)."""
    if network:
        os.environ["GEAR_INSERT_PLANE"] = "0"
    import gear_client as reverb

    rng = np.random.default_rng(os.getpid())
    pool = [{"obs": rng.standard_normal((STEPS, OBS_DIM), dtype=np.float32),
             "action": rng.integers(0, 18, STEPS, dtype=np.int64),
             "reward": rng.standard_normal(STEPS, dtype=np.float32)} for _ in range(4)]
    steps = [[{k: v[t] for k, v in p.items()} for t in range(STEPS)] for p in pool]
    client = reverb.Client(address)
    with client.trajectory_writer(num_keep_alive_refs=STEPS) as writer:
        def one(i: int) -> None:
            for step in steps[i % len(steps)]:
                writer.append(step)
            writer.create_item("t", 1.0, {k: writer.history[k][-STEPS:] for k in ("obs", "action", "reward")})

        for i in range(3):  # warm up: the stream (or insert plane) is open and the layout known
            one(i)
        writer.flush()
        path = "insert plane" if writer._same_host.writer is not None else "InsertStream"
        ready.put(os.getpid())
        go.wait()
        start = time.perf_counter()
        items = 0
        while time.perf_counter() - start < seconds:
            one(items)
            items += 1
        writer.flush()
        elapsed = time.perf_counter() - start
    results.put({"items": items, "seconds": elapsed, "path": path})


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return False


def learner(address: str, seconds: float, device: str | None, ready, go, results, *, prefetch: int | None = None,
            batches_per_select: int | None = None) -> None:
    """Pull B=256 batches over the shm plane for ``seconds`` after ``go``; report GB/s and next() latencies
    (``prefetch``, ``batches_per_select``: the pipeline's, default its own)."""
    from gear_client.data_planes import PlaneSampler

    options = {"prefetch": prefetch} if prefetch is not None else {}
    with PlaneSampler(address, "t", planes=["shm"], device=device) as sampler:
        stream = sampler.batches(BATCH, batches_per_select=batches_per_select, **options)
        for _ in range(3):
            next(stream)
        ready.put(os.getpid())
        go.wait()
        start = time.perf_counter()
        items = 0
        waits = []
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            items += len(next(stream))
            waits.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
        stream.close()
        ms = np.array(waits) * 1e3
        results.put({"learner_gbps": items * ITEM_BYTES / elapsed / 1e9, "plane": sampler.kind,
                     "device": device or "cpu", "n": len(ms), "next_ms_p50": float(np.median(ms)),
                     "p90": float(np.percentile(ms, 90)), "max": float(ms.max()),
                     "sum_over_5ms": float(ms[ms > 5].sum())})


# ------------------------------------------------------------------ runs ----

def run_round(ctx, address: str, actors: int, network: bool, seconds: float, learn: bool = False,
              device: str | None = None) -> dict[str, Any]:
    """K actors (and maybe the learner) started together; aggregate insert GB/s and the learner's figure."""
    ready, go, results, learner_results = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=actor, args=(address, network, seconds, ready, go, results)) for _ in range(actors)]
    if learn:
        procs.append(ctx.Process(target=learner, args=(address, seconds, device, ready, go, learner_results)))
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        out = [results.get(timeout=seconds + 120) for _ in range(actors)]
        learned = learner_results.get(timeout=seconds + 120) if learn else None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    total = sum(r["items"] for r in out)
    window = max((r["seconds"] for r in out), default=seconds)
    row = {"actors": actors, "network": network, "items": total,
           "gbps": total * ITEM_BYTES / window / 1e9 if actors else 0.0,
           "paths": sorted({r["path"] for r in out})}
    if learned is not None:
        row.update(learned)
    return row


def verdict(value: float, goal: float) -> str:
    return "met" if value >= goal else "missed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run for 2-core machines")
    parser.add_argument("--seconds", type=float, help="measurement window per round")
    parser.add_argument("--workers", type=int, help="ingest worker processes of the daemon")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    cpus = os.cpu_count() or 2
    counts = (1, 2, 4) if args.quick else (1, 2, 4, 8, 12)
    mixed_counts = (1, 2) if args.quick else (1, 4, 8)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    workers = args.workers or (2 if args.quick else max(2, min(8, cpus // 2)))
    max_size = 512 if args.quick else 4096
    device = "cuda" if gpu_available() else None
    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(max_size, workers, port_queue, stop))
    server.start()
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}",
                               "item_bytes": ITEM_BYTES, "workers": workers, "device": device or "cpu"}
    started = time.perf_counter()
    try:
        address = f"localhost:{port_queue.get(timeout=60)}"
        print(f"scale benchmark: {ITEM_BYTES / 1024:.1f} KiB trajectories, {workers} ingest workers, "
              f"{seconds:g} s windows ({results['machine']})", flush=True)
        for network in (False, True):
            label = "network-path (ingest workers)" if network else "same-host (insert plane)"
            rows = []
            for k in counts:
                row = run_round(ctx, address, k, network, seconds)
                rows.append(row)
                print(f"  insert {label:32s} {k:2d} actors: {row['gbps']:6.3f} GB/s  "
                      f"({row['gbps'] / rows[0]['gbps']:.2f}x one; via {', '.join(row['paths'])})", flush=True)
            results["network" if network else "same_host"] = rows
        solo = run_round(ctx, address, 0, False, seconds, learn=True, device=device)
        print(f"  learner alone, B={BATCH} over {solo['plane']} into {solo['device']}: "
              f"{solo['learner_gbps']:6.3f} GB/s", flush=True)
        mixed = []
        for k in mixed_counts:
            row = run_round(ctx, address, k, False, seconds, learn=True, device=device)
            row["ratio"] = row["learner_gbps"] / solo["learner_gbps"]
            mixed.append(row)
            print(f"  learner with {k:2d} same-host actors inserting: {row['learner_gbps']:6.3f} GB/s "
                  f"({row['ratio']:.2f}x solo; actors {row['gbps']:.3f} GB/s)", flush=True)
        results["learner_solo"] = solo
        results["mixed"] = mixed
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()
    results["seconds_total"] = time.perf_counter() - started

    def at(rows: list[dict], k: int) -> dict | None:
        return next((r for r in rows if r["actors"] == k), None)

    top = 8 if not args.quick else max(counts)
    scope = f"--quick: measured at {top} actors" if args.quick else "full run"
    print(f"goals (16-core GPU machine; {scope}):")
    same, net = results["same_host"], results["network"]
    checks = []
    if at(same, top):
        speedup = at(same, top)["gbps"] / same[0]["gbps"]
        checks += [(f"same-host {top} actors vs one", speedup, GOALS["same_host_speedup_8"], "x"),
                   (f"same-host {top} actors aggregate", at(same, top)["gbps"], GOALS["same_host_gbps_8"], " GB/s")]
    if at(net, top):
        checks.append((f"network-path {top} actors vs one", at(net, top)["gbps"] / net[0]["gbps"],
                       GOALS["network_speedup_8"], "x"))
    mixed_top = mixed[-1]
    checks.append((f"learner with {mixed_top['actors']} actors vs solo", mixed_top["ratio"], GOALS["mixed_ratio_8"],
                   "x"))
    for name, value, goal, unit in checks:
        print(f"  {name:40s} {value:6.2f}{unit}  goal >= {goal}{unit}: {verdict(value, goal)}")
    results["checks"] = [{"name": n, "value": v, "goal": g, "met": v >= g} for n, v, g, _ in checks]
    print(f"total {results['seconds_total']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
