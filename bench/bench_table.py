"""Benchmark of gear_server.table.table.Table (prints figures; not a test).

    .venv/bin/python bench/bench_table.py [--quick]

Figures and the ceiling each works toward:
* memory of a max_size=1e6 table of 15 KB items: first insert time, shared memory held and
  mapped, and insert latency while it fills (goal: memory follows the items, as in Reverb);
* items of a second layout (tables without a signature): insert and collect cost, column
  slots vs side store;
* insert GB/s of 256 KiB items (ceiling: one memcpy of the same bytes, measured here);
* sample (select + lease + release) latency for B = 32 / 256 at N = 2048 and 1M items,
  uniform and prioritized (reference: full cumsum + searchsorted over N weights,
  what a naive prioritized sampler pays per batch, measured here);
* read (the inline path's copy) GB/s of B = 32 / 256 items of 256 KiB at N = 2048;
* mutate_priorities of 4096 keys at N = 2048 and 1M.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.storage import SegmentStore
from gear_server.table.table import ItemToInsert, Table, TableSnapshot

LEAF = pb.Structure()
UNLIMITED = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1.7976931348623157e308,
                                  max_diff=1.7976931348623157e308)


def selector(kind: str) -> pb.SelectorOptions:
    if kind == "prioritized":
        return pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.6))
    return pb.SelectorOptions(uniform=True)


def make(store: SegmentStore, name: str, max_size: int, sampler: str = "uniform") -> Table:
    cfg = pb.TableConfig(name=name, sampler=selector(sampler), remover=pb.SelectorOptions(fifo=True),
                         max_size=max_size, rate_limiter=UNLIMITED)
    return Table(cfg, store, seed=0)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def memcpy_gbps(nbytes: int, repeats: int = 50) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    t = min(timed(lambda: np.copyto(dst, src), repeats))
    return nbytes / t / 1e9


def scattered_copy_gbps(item_bytes: int, n_slots: int, repeats: int) -> float:
    """One item copied into rotating slots of a large buffer: the memory-bandwidth ceiling of inserts."""
    src = np.random.default_rng(0).integers(0, 255, item_bytes, dtype=np.uint8)
    dst = np.empty((n_slots, item_bytes), np.uint8)
    dst.fill(1)  # pages touched once, like the table's segment (allocated up front)
    order = np.random.default_rng(1).permutation(n_slots).tolist()
    t0 = time.perf_counter()
    for i in range(repeats):
        dst[order[i % n_slots]] = src
    return repeats * item_bytes / (time.perf_counter() - t0) / 1e9


def bench_insert(store: SegmentStore, n_items: int, item_bytes: int) -> None:
    table = make(store, "insert", max_size=max(64, n_items // 2))
    steps = 64
    data = np.random.default_rng(1).random(item_bytes // 4, dtype=np.float32).reshape(steps, -1)
    items = [ItemToInsert(k, 1.0, LEAF, [data], [False]) for k in range(n_items)]
    # fill past max_size + spare once: the segment reaches its full size and every slot's
    # memory is allocated, so growth and first-touch page faults are not what we measure
    warm = table.max_size + table.max_size // 4
    for it in items[:warm]:
        table.insert(it)
    t0 = time.perf_counter()
    for it in items[warm:]:
        table.insert(it)
    dt = time.perf_counter() - t0
    done = n_items - warm
    gbps = done * item_bytes / dt / 1e9
    ceiling = scattered_copy_gbps(item_bytes, table.capacity, done)
    print(f"insert  {item_bytes // 1024} KiB items: {gbps:6.2f} GB/s  ({dt / done * 1e6:7.1f} us/item, "
          f"{done} items)   ceiling: the same copies into scattered slots {ceiling:6.2f} GB/s")
    table.close()


def bench_memory(store: SegmentStore, max_size: int, item_bytes: int, fill: int) -> None:
    """Memory as a large table fills: first insert, bytes held, insert latency while it grows.

    Goal: the first insert is fast and commits about one reservation step, and
    the table holds about what its items need (Reverb allocates per item); no insert stalls
    for long while the segment grows.
    """
    cfg = pb.TableConfig(name="memory", sampler=selector("uniform"), remover=pb.SelectorOptions(fifo=True),
                         max_size=max_size, rate_limiter=UNLIMITED)
    data = np.ones((1, item_bytes // 4), np.float32)
    t0 = time.perf_counter()
    table = Table(cfg, store, seed=0)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    table.insert(ItemToInsert(0, 1.0, LEAF, [data], [False]))
    first = time.perf_counter() - t0
    layout = table.layout()
    held = os.stat(layout.segment).st_blocks * 512
    up_front = max_size * layout.columns[0].slot_stride  # what a table sized for max_size at once holds
    print(f"memory  max_size={max_size:.0e} {item_bytes / 1e3:.0f} KB items: table {built * 1e3:6.1f} ms, "
          f"first insert {first * 1e3:6.1f} ms, shm held {held / 2**20:6.1f} MiB, mapped "
          f"{layout.segment_size / 2**20:6.1f} MiB   (max_size reserved up front: {up_front / 1e9:5.1f} GB)")
    lat = np.empty(fill - 1)
    t_fill = time.perf_counter()
    for k in range(1, fill):
        t0 = time.perf_counter()
        table.insert(ItemToInsert(k, 1.0, LEAF, [data], [False]))
        lat[k - 1] = time.perf_counter() - t0
    t_fill = time.perf_counter() - t_fill
    layout = table.layout()
    held = os.stat(layout.segment).st_blocks * 512
    used = fill * layout.columns[0].slot_stride
    print(f"memory  after {fill} items ({used / 2**20:6.1f} MiB of slots): shm held {held / 2**20:6.1f} MiB, "
          f"mapped {layout.segment_size / 2**20:6.1f} MiB, layout v{layout.version}; insert median "
          f"{np.median(lat) * 1e6:6.1f} us, p99.9 {np.percentile(lat, 99.9) * 1e3:6.2f} ms, max "
          f"{lat.max() * 1e3:6.2f} ms ({fill * item_bytes / t_fill / 1e9:5.2f} GB/s)")
    table.close()


def bench_side(store: SegmentStore, n: int, item_bytes: int, repeats: int) -> None:
    """Items of a second layout in a table without a signature: what they cost.

    The first item's layout gets the column slots; items of another dtype go to the side store
    (arrays of their own, inline plane only). Figures, per kind: insert time per item, and the
    time to collect a batch of B=32 for a sample message (Table.item_groups + joining the bytes).
    Goal: the side store within a small factor of the column slots.
    """
    main = np.ones((1, item_bytes // 4), np.float32)
    other = np.ones((1, item_bytes // 8), np.int64)
    for kind, first, data in (("column slots", main, main), ("side store", main, other)):
        cfg = pb.TableConfig(name=f"side-{kind[:4]}", sampler=selector("uniform"),
                             remover=pb.SelectorOptions(fifo=True), max_size=n + 1, rate_limiter=UNLIMITED)
        table = Table(cfg, store, seed=0)
        table.insert(ItemToInsert(0, 0.0, LEAF, [first], [False]))  # fixes the column layout
        t0 = time.perf_counter()
        for k in range(1, n + 1):
            table.insert(ItemToInsert(k, 1.0, LEAF, [data], [False]))
        insert_s = (time.perf_counter() - t0) / n
        t = []
        for _ in range(repeats):
            sel = table.sample(32)
            t0 = time.perf_counter()
            b"".join(p for g in table.item_groups(sel) for col in g.parts for p in col)
            t.append(time.perf_counter() - t0)
            table.release(sel.lease_id)
        print(f"side    {item_bytes // 1024:>3} KiB items in the {kind:<12}: insert {insert_s * 1e6:7.1f} us/item, "
              f"B=32 collected for sending {statistics.median(t) * 1e3:6.3f} ms")
        table.close()


def table_with(store: SegmentStore, name: str, n: int, sampler: str, item_bytes: int) -> Table:
    """An n-item table built by restore (fast), items of item_bytes bytes."""
    steps = 64 if item_bytes >= 64 * 8 else 1
    width = item_bytes // 4 // steps
    table = make(store, name, max_size=n, sampler=sampler)
    rng = np.random.default_rng(2)
    seqs = np.arange(1, n + 1, dtype=np.int64)
    column = np.zeros((n * steps, width), np.float32)
    snap = TableSnapshot(arrays={
        "keys": np.arange(n, dtype=np.uint64), "priorities": rng.random(n) + 0.01, "insert_seq": seqs,
        "update_seq": seqs, "times_sampled": np.zeros(n, np.int32), "lengths": np.full((n, 1), steps, np.int32),
        "column/0": column, "episode_counts": np.zeros(n, np.int64), "episode_ids": np.zeros(0, np.uint64),
        "structure": np.frombuffer(LEAF.SerializeToString(), np.uint8)},
        scalars={"name": name, "num_items": n, "has_structure": True, "seq": n,
                 "columns": [{"name": "x", "dtype": "<f4", "shape": [width], "squeeze": False,
                              "max_length": steps}],
                 "rate_limiter": {"inserts": n, "samples": 0, "deletes": 0}, "num_deleted_episodes": 0,
                 "num_unique_samples": 0})
    table.restore(snap)
    return table


def bench_sample(store: SegmentStore, n: int, repeats: int) -> None:
    weights = np.random.default_rng(3).random(n)
    naive = statistics.median(timed(lambda: np.searchsorted(np.cumsum(weights), np.random.random(256)), repeats))
    for sampler in ("uniform", "prioritized"):
        table = table_with(store, f"s{n}{sampler}", n, sampler, item_bytes=64)
        for b in (32, 256):
            def once(b=b, table=table):
                sel = table.sample(b)
                table.release(sel.lease_id)
            once()
            t = timed(once, repeats)
            print(f"sample  N={n:>8} {sampler:<11} B={b:<4} median {statistics.median(t) * 1e6:8.1f} us  "
                  f"p90 {np.percentile(t, 90) * 1e6:8.1f} us")
        if sampler == "prioritized":
            keys = np.random.default_rng(4).choice(n, min(4096, n), replace=False)
            updates = {int(k): float(v) for k, v in zip(keys, np.random.default_rng(5).random(len(keys)) + 0.1,
                                                         strict=True)}
            t = timed(lambda updates=updates, table=table: table.mutate_priorities(updates), max(3, repeats // 10))
            print(f"mutate  N={n:>8} prioritized {len(keys)} keys: median {statistics.median(t) * 1e3:7.2f} ms")
        table.close()
    print(f"        (reference: cumsum + searchsorted over all {n} weights, B=256: {naive * 1e6:8.1f} us)")


def bench_read(store: SegmentStore, n: int, item_bytes: int, repeats: int) -> None:
    table = table_with(store, "read", n, "uniform", item_bytes)
    for b in (32, 256):
        sel = table.sample(b)
        table.read(sel)
        t = statistics.median(timed(lambda sel=sel: table.read(sel), repeats))
        table.release(sel.lease_id)
        print(f"read    N={n} B={b:<4} {item_bytes // 1024} KiB items: {b * item_bytes / t / 1e9:6.2f} GB/s "
              f"({t * 1e3:6.2f} ms)   ceiling memcpy {memcpy_gbps(b * item_bytes, 10):6.2f} GB/s")
    table.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and items")
    parser.add_argument("--shm-dir", default="/dev/shm")
    args = parser.parse_args()
    repeats = 20 if args.quick else 100
    store = SegmentStore(args.shm_dir, f"bench{uuid.uuid4().hex[:8]}")
    print(f"gear table benchmark (pid {os.getpid()}, numpy {np.__version__}, {os.cpu_count()} cpus)")
    try:
        bench_memory(store, 1_000_000, 15_000, fill=5_000 if args.quick else 40_000)
        for item_bytes in (1024, 256 * 1024):
            bench_side(store, 256 if item_bytes > 4096 else 4096, item_bytes, repeats)
        bench_insert(store, n_items=1024 if args.quick else 4096, item_bytes=256 * 1024)
        bench_read(store, 2048, 256 * 1024, repeats=max(5, repeats // 4))
        bench_sample(store, 2048, repeats)
        bench_sample(store, 1_000_000, repeats)
    finally:
        store.close()


if __name__ == "__main__":
    main()
