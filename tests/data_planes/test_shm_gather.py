"""The shm plane's CPU gather: vectorised reads of small columns, ranges planned only where needed."""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.data_planes.range_planning import (
    LENGTH,
    BatchLayout,
    plan_ranges,
    resolve_windows,
    window_bounds,
    window_steps,
)
from gear_client.data_planes.shm import MEMCPY_ITEM_BYTES, SegmentMapping, gather_numpy
from gear_contract.layout import TableLayout
from gear_kernels import Window
from gear_kernels import gather_numpy as twin


@pytest.fixture
def segment(tmp_path):
    """A table of small squeezed, small windowed and large columns, random bytes in every slot."""
    big = MEMCPY_ITEM_BYTES // 4  # float32 per step: a step of exactly MEMCPY_ITEM_BYTES
    layout = TableLayout.build("t", str(tmp_path / "segment"), 1000, [
        ("flag", np.int64, (), 1, True),
        ("obs", np.float32, (3,), 6, False),
        ("image", np.float32, (big,), 2, False),
    ])
    data = np.random.default_rng(0).integers(0, 256, layout.segment_size, dtype=np.uint8)
    data.tofile(layout.segment)
    mapping = SegmentMapping(layout)
    yield layout, mapping, data
    mapping.close()


@pytest.mark.parametrize("window", [None, Window(4, -4), Window(6, 0, "head")])
@pytest.mark.parametrize("full", [True, False])
def test_gather_plans_its_own_ranges_and_matches_the_kernel_twin(segment, window, full):
    layout, mapping, data = segment
    rng = np.random.default_rng(1)
    n = 40
    slots = rng.integers(0, layout.capacity, n)
    lengths = np.full((n, 3), [1, 6, 2]) if full else rng.integers(1, 7, (n, 3)).clip(max=[1, 6, 2])
    windows = resolve_windows(layout, window)
    batch = BatchLayout.build(layout, n, window_steps(windows))
    bounds = window_bounds(lengths, layout, windows)
    want = twin(layout, data, slots, lengths.astype(np.int32), windows).buffer[:batch.nbytes]
    for ranges in (None, plan_ranges(layout, slots, *bounds[:2], batch, bounds[2])):
        out = np.full(batch.nbytes, 0xEE, np.uint8)  # stale bytes: padding must be written, not assumed
        gather_numpy(mapping, slots, bounds, ranges, batch, out)
        for dst in batch.columns:  # the columns' blocks (the alignment gaps between them hold nothing)
            block = slice(dst.offset, dst.offset + n * dst.item_bytes)
            np.testing.assert_array_equal(out[block], want[block])


def test_planned_column_subset_and_slots_checked(segment):
    layout, mapping, _ = segment
    slots = np.array([3, 999, 0])
    windows = resolve_windows(layout, None)
    batch = BatchLayout.build(layout, 3, window_steps(windows))
    starts, counts, firsts = window_bounds(np.full((3, 3), [1, 6, 2]), layout, windows)
    every = plan_ranges(layout, slots, starts, counts, batch, firsts)
    only = plan_ranges(layout, slots, starts, counts, batch, firsts, columns=[2])
    np.testing.assert_array_equal(only, every[-3:])
    assert only[:, LENGTH].tolist() == [2 * MEMCPY_ITEM_BYTES] * 3
    out = np.empty(batch.nbytes, np.uint8)
    for bad in (np.array([3, 1000, 0]), np.array([-1, 2, 0])):  # a negative slot must not wrap around
        with pytest.raises(ValueError, match="slot out of range"):
            gather_numpy(mapping, bad, (starts, counts, firsts), None, batch, out)


@pytest.mark.parametrize("window", [None, 4, [Window(1), Window(6, 0, "head"), Window(2)],
                                    [Window(1), Window(3, -3, "head"), Window(1, 1)], "per-item"])
def test_window_bounds_of_all_columns_at_once_match_the_kernel_twin_per_column(segment, window):
    """window_bounds works on every column at once; each column equals gear_kernels' twin of the kernel."""
    from gear_kernels import twins

    layout = segment[0]
    rng = np.random.default_rng(3)
    lengths = rng.integers(-1, 9, (50, len(layout.columns)))
    if window == "per-item":
        window = [Window(1), Window(4, rng.integers(-6, 6, 50), "head"), Window(2)]
    windows = resolve_windows(layout, window)
    got = window_bounds(lengths, layout, windows)
    for c, (col, w) in enumerate(zip(layout.columns, windows, strict=True)):
        start = np.broadcast_to(np.asarray(w.start, dtype=np.int64), (50,))
        want = twins.window_bounds(lengths[:, c], start, int(w.length), col.max_length, w.pad == "head")
        for g, x in zip(got, want, strict=True):
            assert g.dtype == np.int64 and g.shape == lengths.shape
            np.testing.assert_array_equal(g[:, c], x)
