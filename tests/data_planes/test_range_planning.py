"""Range planning: windows, byte ranges, coalescing, splitting, spreading over queue pairs, chains."""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.data_planes.range_planning import (
    LENGTH,
    LOCAL,
    REMOTE,
    BatchLayout,
    chain,
    coalesce,
    padding_ranges,
    plan_ranges,
    plan_reads,
    resolve_windows,
    split,
    spread,
    window_bounds,
    window_steps,
)
from gear_contract.layout import TableLayout
from gear_kernels import Window, gather_numpy
from gear_kernels.gather import output_plan


def layout(capacity: int = 16, max_length: int = 8, squeeze_last: bool = False) -> TableLayout:
    return TableLayout.build("t", "", capacity, [
        ("action", np.int64, (), max_length, False),
        ("obs", np.float32, (5,), max_length, False),
        ("flag", np.uint8, (3,), 1 if squeeze_last else max_length, squeeze_last),
    ])


def random_segment(lay: TableLayout, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, lay.segment_size, dtype=np.uint8)


def execute(ranges: np.ndarray, src: np.ndarray, nbytes: int) -> np.ndarray:
    out = np.full(nbytes, 0xEE, dtype=np.uint8)
    for r, loc, n in ranges.tolist():
        out[loc:loc + n] = src[r:r + n]
    return out


@pytest.mark.parametrize("window", [None, 4, Window(3, -3), Window(6, 2, "head"), Window(16, 0)])
def test_planned_ranges_move_the_same_bytes_as_the_gather_kernel_twin(window):
    lay = layout()
    seg = random_segment(lay)
    rng = np.random.default_rng(1)
    slots = rng.integers(0, lay.capacity, 10)
    lengths = rng.integers(1, 9, (10, 3)).astype(np.int32)
    windows = resolve_windows(lay, window)
    batch = BatchLayout.build(lay, 10, window_steps(windows))
    src, count, first = window_bounds(lengths, lay, windows)
    ranges = plan_ranges(lay, slots, src, count, batch, first)
    out = execute(ranges, seg, batch.nbytes)
    for off, n in padding_ranges(count, batch, first).tolist():
        out[off:off + n] = 0
    reference = gather_numpy(lay, seg, slots, lengths, windows)
    offsets, _ = output_plan(lay, 10, None, windows)
    assert [c.offset for c in batch.columns] == offsets  # one placement for CPU, RDMA and GPU batches
    for col in batch.columns:  # every row byte (not the alignment gaps between column blocks)
        block = slice(col.offset, col.offset + 10 * col.item_bytes)
        assert np.array_equal(out[block], reference.buffer[block])
    assert np.array_equal(count, reference.lengths)


def test_squeezed_columns_take_one_step_whatever_the_window():
    lay = layout(squeeze_last=True)
    windows = resolve_windows(lay, Window(4, -4))
    assert window_steps(windows) == [4, 4, 1]
    _, count, _ = window_bounds(np.array([[8, 8, 1]]), lay, windows)
    assert count.tolist() == [[4, 4, 1]]


def test_bad_windows_are_refused():
    lay = layout()
    with pytest.raises(ValueError):
        resolve_windows(lay, [Window(2)] * 2)
    with pytest.raises(TypeError):
        resolve_windows(lay, "all")
    with pytest.raises(ValueError):
        Window(0)


def test_plan_ranges_refuses_slots_outside_the_table():
    lay = layout()
    batch = BatchLayout.build(lay, 1, [8, 8, 8])
    zeros = np.zeros((1, 3), np.int64)
    with pytest.raises(ValueError, match="slot"):
        plan_ranges(lay, np.array([lay.capacity]), zeros, zeros + 1, batch)


def test_padding_ranges_are_exactly_the_bytes_no_read_fills():
    lay = layout()
    lengths = np.array([[8, 8, 8], [3, 5, 0], [1, 8, 2]])
    windows = resolve_windows(lay, Window(6, -6, "head"))
    batch = BatchLayout.build(lay, 3, window_steps(windows))
    src, count, first = window_bounds(lengths, lay, windows)
    ranges = plan_ranges(lay, np.array([0, 1, 2]), src, count, batch, first)
    covered = np.zeros(batch.nbytes, dtype=np.int32)
    for _, loc, n in ranges.tolist():
        covered[loc:loc + n] += 1
    for off, n in padding_ranges(count, batch, first).tolist():
        covered[off:off + n] += 1
    for col in batch.columns:  # every byte of every row: filled once, by a read or by padding
        assert np.all(covered[col.offset:col.offset + 3 * col.item_bytes] == 1)


def test_coalesce_merges_ranges_adjacent_on_both_sides_only():
    ranges = np.array([
        [1000, 0, 100],
        [1100, 100, 100],  # continues the first on both sides
        [1200, 300, 100],  # remote-adjacent but not local-adjacent
        [5000, 400, 50],
        [5050, 450, 50],   # continues the previous
    ], dtype=np.int64)
    merged = coalesce(ranges[::-1].copy())  # order does not matter
    assert sorted(map(tuple, merged.tolist())) == [(1000, 0, 200), (1200, 300, 100), (5000, 400, 100)]


def test_coalescing_consecutive_slots_of_a_fifo_batch():
    lay = TableLayout.build("t", "", 32, [("obs", np.float32, (1024,), 64, False)])  # stride = 64 steps exactly
    batch = BatchLayout.build(lay, 8, [64])
    lengths = np.full((8, 1), 64)
    src, count, first = window_bounds(lengths, lay, resolve_windows(lay, None))
    ranges = plan_ranges(lay, np.arange(4, 12), src, count, batch, first)
    merged = coalesce(ranges)
    assert len(ranges) == 8 and len(merged) == 1 and merged[0, LENGTH] == 8 * 64 * 4096
    seg = random_segment(lay)
    assert np.array_equal(execute(merged, seg, batch.nbytes), execute(ranges, seg, batch.nbytes))


def test_split_caps_every_range_and_keeps_the_bytes():
    ranges = np.array([[0, 0, 10], [100, 50, 25], [1000, 200, 7]], dtype=np.int64)
    pieces = split(ranges, 8)
    assert pieces[:, LENGTH].max() <= 8
    assert pieces[:, LENGTH].sum() == ranges[:, LENGTH].sum()
    src = np.arange(2000, dtype=np.int64).astype(np.uint8)
    assert np.array_equal(execute(pieces, src, 300), execute(ranges, src, 300))
    with pytest.raises(ValueError):
        split(ranges, 0)


def test_spread_balances_bytes_over_queue_pairs():
    rng = np.random.default_rng(3)
    n = 200
    ranges = np.stack([rng.integers(0, 1 << 30, n), np.arange(n) * 10_000, rng.integers(1, 8192, n)], axis=1)
    queues = spread(ranges, 4)
    loads = [int(q[:, LENGTH].sum()) for q in queues]
    assert sum(loads) == int(ranges[:, LENGTH].sum())
    assert max(loads) - min(loads) <= int(ranges[:, LENGTH].max())  # LPT bound
    assert sorted(map(tuple, np.concatenate(queues).tolist())) == sorted(map(tuple, ranges.tolist()))
    for q in queues:  # segment order within a queue pair
        assert np.all(np.diff(q[:, REMOTE]) >= 0)
    assert [len(q) for q in spread(ranges[:2], 4)].count(0) == 2


def test_chains_are_bounded_and_ids_unique():
    queues = [np.zeros((37, 3), np.int64), np.zeros((0, 3), np.int64), np.zeros((16, 3), np.int64)]
    chains = chain(queues, 16, first_wr_id=100)
    assert [[len(c.ranges) for c in q] for q in chains] == [[16, 16, 5], [], [16]]
    ids = [c.wr_id for q in chains for c in q]
    assert len(set(ids)) == len(ids) and min(ids) == 100
    assert all(c.queue == q for q, cs in enumerate(chains) for c in cs)


def test_plan_reads_end_to_end_moves_every_byte_once():
    lay = layout(capacity=64)
    seg = random_segment(lay, 5)
    rng = np.random.default_rng(2)
    slots = rng.integers(0, 64, 40)
    lengths = np.full((40, 3), 8)
    windows = resolve_windows(lay, None)
    batch = BatchLayout.build(lay, 40, window_steps(windows))
    src, count, first = window_bounds(lengths, lay, windows)
    ranges = plan_ranges(lay, slots, src, count, batch, first)
    plan = plan_reads(ranges, num_queues=3, max_message=96, chain_length=4, balance_chunk=64)
    assert plan.nbytes == int(ranges[:, LENGTH].sum())
    pieces = np.concatenate([c.ranges for q in plan.chains for c in q])
    assert pieces[:, LENGTH].max() <= 64 and plan.num_requests == len(pieces)
    assert all(len(c.ranges) <= 4 for q in plan.chains for c in q)
    assert np.array_equal(execute(pieces, seg, batch.nbytes), execute(ranges, seg, batch.nbytes))
    assert len({tuple(r) for r in pieces[:, (LOCAL,)].tolist()}) == len(pieces)  # no byte written twice
