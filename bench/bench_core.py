"""Core benchmark: insert, sample and mutate_priorities through the Reverb API.

The very same code runs against gear (``--backend gear``: ``import gear_client
as reverb``) and against DeepMind Reverb (``--backend reverb``, from the
``.venv-reverb`` environment that ``make bench-reverb`` builds), with the server
in another process and the client talking to it over loopback.

Workload: trajectories of 64 steps of {obs: float32[1024], action: int64,
reward: float32} (256.8 KiB each) written with one TrajectoryWriter into a
Uniform table of 2048 items (max_size 2048), once with a single flush at the
end (throughput) and once with ``flush(block_until_num_items=8)`` after each
item (a bounded pipeline); then ``client.sample(table, B,
emit_timesteps=False)`` for B = 32 and 256, stacked into numpy arrays; then
``mutate_priorities`` of sampled keys on a Prioritized(0.8) table of 2048
items. Figures are GB/s of payload (10^9 bytes per second) and the latency of
one mutate_priorities call.

Sampling is measured over the network path (gRPC, the sampled bytes inline in
the responses), which is the figure compared with Reverb; gear's client is
kept on it with ``GEAR_DATA_PLANES=inline`` while it is constructed (an
environment variable, so the Reverb-style calls are the same for both
backends). For gear only, a second client that may negotiate the shared-memory
data plane (same host) is measured as an extra row; Reverb has one path.

gear's goal: at least twice Reverb's figures, both measured side by side on the
same machine (``make bench-reverb``, bench/reverb/compare.py). No fixed Reverb
figures are printed: the ones quoted for a 2-core machine before this work were
not reproduced (docs/BENCHMARKS.md). The client's allocator tuning is on
(``GEAR_MALLOC_TUNING=1``, opt-in for users), as in the published figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

STEPS = 64
OBS_DIM = 1024
STEP_BYTES = OBS_DIM * 4 + 8 + 4
ITEM_BYTES = STEPS * STEP_BYTES
GOAL_RATIO = 2.0  # gear / Reverb, measured side by side
os.environ.setdefault("GEAR_MALLOC_TUNING", "1")  # client processes inherit it (see the docstring)
BATCHES = (32, 256)
# Which sample path each client takes: the value of GEAR_DATA_PLANES while it is constructed (gear reads it
# there; Reverb ignores it). "inline": every sample over gRPC; "shm,rdma": gear's default negotiation.
NETWORK_PLANES = "inline"
SHM_PLANES = "shm"


def import_backend(backend: str):
    if backend == "reverb":
        import reverb
    else:
        import gear_client as reverb
    return reverb


def _serve(backend: str, num_items: int, port_queue, stop_event) -> None:
    """The server process: one Uniform and one Prioritized(0.8) table, until told to stop."""
    reverb = import_backend(backend)
    tables = [
        reverb.Table("uniform", reverb.selectors.Uniform(), reverb.selectors.Fifo(), num_items,
                     reverb.rate_limiters.MinSize(1)),
        reverb.Table("prioritized", reverb.selectors.Prioritized(0.8), reverb.selectors.Fifo(), num_items,
                     reverb.rate_limiters.MinSize(1)),
    ]
    server = reverb.Server(tables, port=None)
    port_queue.put(server.port)
    stop_event.wait()
    server.stop()


def _trajectories(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Distinct random trajectories (incompressible, so no backend gains from compression)."""
    rng = np.random.default_rng(seed)
    return [{
        "obs": rng.standard_normal((STEPS, OBS_DIM), dtype=np.float32),
        "action": rng.integers(0, 18, STEPS, dtype=np.int64),
        "reward": rng.standard_normal(STEPS, dtype=np.float32),
    } for _ in range(count)]


def write_items(client, table: str, num_items: int, pool: list[dict[str, np.ndarray]],
                columns: tuple[str, ...] = ("obs", "action", "reward"), pipeline: int = 0) -> float:
    """Write ``num_items`` trajectories with one TrajectoryWriter; seconds taken (until all are in).

    ``pipeline`` > 0: after each item, ``flush(block_until_num_items=pipeline)``.
    """
    # The steps as an actor would hold them (one dict of arrays per step), built before the clock starts.
    steps = [[{name: trajectory[name][t] for name in columns} for t in range(STEPS)] for trajectory in pool]
    start = time.perf_counter()
    with client.trajectory_writer(num_keep_alive_refs=STEPS) as writer:
        for i in range(num_items):
            for step in steps[i % len(steps)]:
                writer.append(step)
            writer.create_item(table, 1.0, {name: writer.history[name][-STEPS:] for name in columns})
            if pipeline:
                writer.flush(block_until_num_items=pipeline)
        writer.flush()
    return time.perf_counter() - start


def connect(reverb, address: str, planes: str | None = None):
    """``reverb.Client(address)``, constructed with ``GEAR_DATA_PLANES=planes`` (None: the default planes)."""
    saved = os.environ.get("GEAR_DATA_PLANES")
    try:
        if planes is not None:
            os.environ["GEAR_DATA_PLANES"] = planes
        return reverb.Client(address)
    finally:
        if saved is None:
            os.environ.pop("GEAR_DATA_PLANES", None)
        else:
            os.environ["GEAR_DATA_PLANES"] = saved


def sample_batches(client, table: str, batch: int, total_items: int) -> tuple[float, int]:
    """Sample batches of ``batch`` items, stacked per column; (seconds, items sampled)."""
    done = 0
    start = time.perf_counter()
    while done < total_items:
        samples = list(client.sample(table, batch, emit_timesteps=False))
        columns = [np.stack([s.data[c] for s in samples]) for c in range(len(samples[0].data))]
        assert columns[1].shape == (batch, STEPS, OBS_DIM), columns[1].shape  # action, obs, reward
        done += batch
    return time.perf_counter() - start, done


def mutate_latencies(client, table: str, batch: int, rounds: int) -> list[float]:
    """Latency of mutate_priorities updating ``batch`` sampled keys, per call (seconds)."""
    rng = np.random.default_rng(1)
    out = []
    for _ in range(rounds):
        keys = [s.info.key for s in client.sample(table, batch, emit_timesteps=False)]
        updates = {k: float(p) for k, p in zip(keys, rng.uniform(0.1, 10.0, len(keys)), strict=True)}
        start = time.perf_counter()
        client.mutate_priorities(table, updates=updates)
        out.append(time.perf_counter() - start)
    return out


def run(backend: str, num_items: int, sample_items: int, mutate_rounds: int) -> dict[str, Any]:
    reverb = import_backend(backend)
    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(backend, num_items, port_queue, stop_event), daemon=True)
    server.start()
    try:
        port = port_queue.get(timeout=180)
        client = connect(reverb, f"localhost:{port}", NETWORK_PLANES)
        client.server_info(timeout=60)
        pool = _trajectories(8)
        results: dict[str, Any] = {"backend": backend, "num_items": num_items, "item_bytes": ITEM_BYTES}

        # Throughput: create_item per trajectory, one flush at the end (the writer's own back-pressure only).
        seconds = write_items(client, "uniform", num_items, pool, pipeline=0)
        assert client.server_info(timeout=60)["uniform"].current_size == num_items
        results["insert_gbps"] = num_items * ITEM_BYTES / seconds / 1e9
        results["insert_items_per_s"] = num_items / seconds
        print(f"[{backend}] insert: {num_items} items in {seconds:.2f} s", file=sys.stderr)
        # A bounded pipeline, as an actor keeping at most 8 items unconfirmed: flush(block_until_num_items=8).
        seconds = write_items(client, "uniform", num_items, pool, pipeline=8)
        results["insert_flush8_gbps"] = num_items * ITEM_BYTES / seconds / 1e9
        print(f"[{backend}] insert, flush(8) per item: {num_items} items in {seconds:.2f} s", file=sys.stderr)

        # The network path (the figure compared with Reverb), then, gear only, the shared-memory plane.
        paths = [("sample", client)]
        if backend == "gear":
            paths.append(("sample_shm", connect(reverb, f"localhost:{port}", SHM_PLANES)))
        for prefix, sampler in paths:
            for batch in BATCHES:
                sample_batches(sampler, "uniform", batch, batch)  # warm-up (connections, data plane)
                seconds, done = sample_batches(sampler, "uniform", batch, max(sample_items, batch))
                results[f"{prefix}_b{batch}_gbps"] = done * ITEM_BYTES / seconds / 1e9
                print(f"[{backend}] {prefix} B={batch}: {done} items in {seconds:.2f} s", file=sys.stderr)
        if backend == "gear":
            assert client._data_plane("uniform") is None, "the network-path client negotiated a data plane"
            results["sample_shm_plane"] = paths[1][1]._data_plane("uniform") is not None

        # Prioritized table: light items (the reward column only); the latency measured is the update's.
        write_items(client, "prioritized", num_items, pool, columns=("reward",))
        for batch in BATCHES:
            mutate_latencies(client, "prioritized", batch, 3)  # warm-up
            lat = mutate_latencies(client, "prioritized", batch, mutate_rounds)
            results[f"mutate_b{batch}_ms_median"] = statistics.median(lat) * 1e3
            results[f"mutate_b{batch}_ms_p90"] = float(np.percentile(lat, 90)) * 1e3
        return results
    finally:
        stop_event.set()
        server.join(60)
        if server.is_alive():
            server.kill()


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def print_results(results: dict[str, Any]) -> None:
    b = results["backend"]
    goal = f"goal: >= {GOAL_RATIO:g}x Reverb side by side (make bench-reverb)"
    print(f"core benchmark, backend={b}, {results['num_items']} items of {results['item_bytes'] / 1024:.1f} KiB "
          f"({machine()})")
    print(f"  insert      {results['insert_gbps']:6.3f} GB/s  ({results['insert_items_per_s']:.0f} items/s; "
          f"{goal})")
    print(f"  insert, flush(block_until_num_items=8) after each item: {results['insert_flush8_gbps']:6.3f} GB/s")
    for batch in BATCHES:
        print(f"  sample B={batch:<3} (network path: gRPC inline) {results[f'sample_b{batch}_gbps']:6.3f} GB/s  "
              f"({goal})")
    if "sample_shm_b32_gbps" in results:
        note = "" if results.get("sample_shm_plane") else "  [shm plane NOT negotiated: these are inline]"
        for batch in BATCHES:
            print(f"  sample B={batch:<3} (shm plane, same host)     {results[f'sample_shm_b{batch}_gbps']:6.3f} "
                  f"GB/s{note}")
    for batch in BATCHES:
        print(f"  mutate_priorities of {batch:>3} keys: median {results[f'mutate_b{batch}_ms_median']:.2f} ms, "
              f"p90 {results[f'mutate_b{batch}_ms_p90']:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gear", "reverb"), default="gear")
    parser.add_argument("--items", type=int, default=2048, help="trajectories written (= table max_size)")
    parser.add_argument("--sample-items", type=int, default=2048, help="items sampled per batch size")
    parser.add_argument("--mutate-rounds", type=int, default=30)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    results = run(args.backend, args.items, args.sample_items, args.mutate_rounds)
    results["machine"] = machine()
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
