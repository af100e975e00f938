"""Hand-framed protobuf pieces (gear_contract/wire.py) against protobuf's own encoder and parser.

For every framed message, at several sizes, the median time of one encode
(or decode) framed by hand and through protobuf, and which one wins. A piece
is kept framed by hand only where it wins: sample responses under
``wire.HAND_DECODE_MIN_BYTES`` are decoded by protobuf.

Messages:
- insert chunk: ``InsertStreamRequest`` with one ChunkData of ``rows`` float32[1024] rows. By hand: the
  head framed around the column buffer, joined once. Protobuf: ``tobytes()`` then serialize.
- insert item: one PrioritizedItem of 3 columns (and of 32 columns) of one slice each.
- release keys: ``release_chunk_keys`` of 3 and 256 keys (protobuf won: the writer uses it).
- sample response encode / decode: B items of T steps of float32[1024] + int64 + float32.
- priority updates: ``MutatePrioritiesRequest`` of 4 to 256 (key, priority) pairs; by hand from the arrays
  the client makes of the caller's dict (``wire.HAND_ENCODE_MIN_UPDATES``), decoded into the key and
  priority lists the daemon hands its table (``wire.HAND_DECODE_MIN_UPDATE_BYTES``).

    .venv/bin/python bench/bench_wire.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gear_contract import wire
from gear_contract._proto import replay_pb2 as pb
from gear_contract.allocator import tune_allocator

OBS = 1024


def _median_us(fn: Callable[[], object], budget_s: float) -> float:
    """Median of per-call times, calls batched so each sample lasts about 1 ms, within ``budget_s``."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(1e-3 / once))
    samples = []
    end = time.perf_counter() + budget_s
    while len(samples) < 5 or (time.perf_counter() < end and len(samples) < 200):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples) * 1e6


def _row(name: str, size: str, hand_us: float, proto_us: float) -> None:
    winner = "hand" if hand_us < proto_us else "protobuf"
    print(f"  {name:<24} {size:>14}  hand {hand_us:9.1f} us  protobuf {proto_us:9.1f} us  "
          f"({proto_us / hand_us:5.2f}x)  -> {winner}")


def bench_chunks(budget: float) -> None:
    for rows in (1, 16, 64, 512):
        _bench_chunk(np.random.default_rng(0).random((rows, OBS), dtype=np.float32), budget)


def _bench_chunk(data: np.ndarray, budget: float) -> None:
    def hand() -> bytes:
        view = memoryview(data.reshape(-1).view(np.uint8))
        head = wire.encode_chunk_head(7, b"<f4", data.shape, view.nbytes, 123456789, 10)
        return b"".join((head, view))

    def proto() -> bytes:
        chunk = pb.ChunkData(chunk_key=7, episode_id=123456789, episode_step=10,
                             data=pb.Tensor(dtype="<f4", shape=data.shape, data=data.tobytes()))
        return pb.InsertStreamRequest(chunks=[chunk]).SerializeToString()

    assert pb.InsertStreamRequest.FromString(hand()) == pb.InsertStreamRequest.FromString(proto())
    _row("insert chunk", f"{data.nbytes >> 10} KiB", _median_us(hand, budget), _median_us(proto, budget))


def bench_items(budget: float) -> None:
    structure = pb.Structure(kind=pb.Structure.DICT, keys=["a", "o", "r"],
                             children=[pb.Structure(), pb.Structure(), pb.Structure()])
    encoded_structure = structure.SerializeToString()
    for n_columns in (3, 32):
        _bench_item([([(1000 + c, 0, 64)], c == 0) for c in range(n_columns)], structure, encoded_structure, budget)


def _bench_item(columns: list, structure: pb.Structure, encoded_structure: bytes, budget: float) -> None:
    n_columns = len(columns)

    def hand() -> bytes:
        return wire.encode_insert_item(2**63 + 5, b"table", 1.5, encoded_structure, columns)

    def proto() -> bytes:
        item = pb.PrioritizedItem(key=2**63 + 5, table="table", priority=1.5, structure=structure, columns=[
            pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=k, offset=o, length=n) for k, o, n in slices],
                          squeeze=squeeze) for slices, squeeze in columns])
        return pb.InsertStreamRequest(items=[item]).SerializeToString()

    assert pb.InsertStreamRequest.FromString(hand()) == pb.InsertStreamRequest.FromString(proto())
    _row("insert item", f"{n_columns} columns", _median_us(hand, budget), _median_us(proto, budget))


def bench_releases(budget: float) -> None:
    for n in (3, 256):
        _bench_release(list(range(10_000, 10_000 + n)), budget)


def _bench_release(keys: list[int], budget: float) -> None:
    n = len(keys)

    def hand() -> bytes:  # what the writer used before this A/B (wire.encode_release_keys is protobuf now)
        packed = b"".join([wire.encode_varint(k) for k in keys])
        return b"\x1a" + wire.encode_varint(len(packed)) + packed

    def proto() -> bytes:
        return wire.encode_release_keys(keys)

    assert hand() == proto()
    _row("release keys", f"{n} keys", _median_us(hand, budget), _median_us(proto, budget))


def bench_priority_updates(budget: float) -> None:
    for n in (4, 16, 32, 64, 256):
        _bench_priority_updates(n, budget)


def _bench_priority_updates(n: int, budget: float) -> None:
    rng = np.random.default_rng(2)
    keys, priorities = rng.integers(0, 2**63, n, dtype=np.uint64), rng.uniform(0, 10, n)
    updates = {int(k): float(p) for k, p in zip(keys, priorities, strict=True)}

    def hand() -> bytes:
        keys = np.fromiter(updates.keys(), np.uint64, n)
        priorities = np.fromiter(updates.values(), np.float64, n)
        return wire.encode_mutate_priorities("prioritized", keys, priorities, np.zeros(0, np.uint64))

    def proto() -> bytes:
        return pb.MutatePrioritiesRequest(table="prioritized", updates=[
            pb.KeyWithPriority(key=int(k), priority=float(p)) for k, p in updates.items()]).SerializeToString()

    raw, raw_proto = hand(), proto()
    assert pb.MutatePrioritiesRequest.FromString(raw) == pb.MutatePrioritiesRequest.FromString(raw_proto)

    def hand_decode() -> wire.PriorityUpdates | None:
        return wire.decode_mutate_priorities_by_hand(raw)

    def proto_decode() -> wire.PriorityUpdates:
        return wire.decode_mutate_priorities_by_protobuf(raw)

    assert hand_decode() == proto_decode()
    _row("priority updates encode", f"{n} keys", _median_us(hand, budget), _median_us(proto, budget))
    _row("priority updates decode", f"{n} keys", _median_us(hand_decode, budget), _median_us(proto_decode, budget))


def _sample_parts(items: int, steps: int):
    rng = np.random.default_rng(1)
    obs = rng.random((items * steps, OBS), dtype=np.float32)
    act = np.arange(items * steps, dtype=np.int64)
    rew = rng.random(items * steps, dtype=np.float32)
    infos = [pb.SampleInfo(key=2**40 + i, probability=1.0 / items, table_size=4096, priority=1.0, times_sampled=1)
             for i in range(items)]
    lengths = np.full((items, 3), steps, np.int32)
    structure = pb.Structure(kind=pb.Structure.DICT, keys=["action", "obs", "reward"],
                             children=[pb.Structure(), pb.Structure(), pb.Structure()])
    # Per column, one part per item (the daemon joins slot views without copying them first).
    columns = [(a.dtype, a.shape[1:], [a[i * steps:(i + 1) * steps] for i in range(items)]) for a in (act, obs, rew)]
    return infos, lengths, structure, columns


def bench_sample_responses(budget: float, quick: bool) -> None:
    shapes = [(8, 1), (8, 2), (16, 2), (32, 2), (32, 8), (256, 1), (32, 16), (32, 64), (256, 8)]
    if not quick:
        shapes.append((256, 64))
    for items, steps in shapes:
        _bench_sample_response(items, steps, budget)


def _bench_sample_response(items: int, steps: int, budget: float) -> None:
    infos, lengths, structure, columns = _sample_parts(items, steps)
    squeeze = [False, False, False]

    def hand_encode() -> bytes:
        return wire.encode_sample_response(infos, lengths, structure, squeeze, columns)

    def proto_encode() -> bytes:
        tensors = [pb.Tensor(dtype=dt.str, shape=[items * steps, *shape],
                             data=b"".join(memoryview(np.ascontiguousarray(p)) for p in parts))
                   for dt, shape, parts in columns]
        batch = pb.SampleBatch(info=infos, columns=tensors, lengths=lengths.reshape(-1).tolist(),
                               structure=structure, squeeze=squeeze)
        return pb.SampleResponse(batch=batch).SerializeToString()

    raw = hand_encode()
    assert pb.SampleResponse.FromString(raw) == pb.SampleResponse.FromString(proto_encode())
    size = f"{len(raw) / 2**20:.2f} MiB B={items}"
    _row("sample response encode", size, _median_us(hand_encode, budget), _median_us(proto_encode, budget))
    _row("sample response decode", size,
         _median_us(lambda: wire.decode_sample_response_by_hand(raw), budget),
         _median_us(lambda: wire.decode_sample_response_by_protobuf(raw), budget))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, no 16 MiB response")
    args = parser.parse_args(argv)
    budget = 0.1 if args.quick else 0.4
    tune_allocator()  # as the writer, the daemon and learners run (multi-MiB buffers stay in the heap)
    print("hand-framed vs protobuf (median per call; lower wins)")
    bench_chunks(budget)
    bench_items(budget)
    bench_releases(budget)
    bench_priority_updates(budget)
    bench_sample_responses(budget, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
