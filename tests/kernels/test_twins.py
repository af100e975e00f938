"""The NumPy twins of the selection and collection kernels, against plain references (no GPU needed)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from gear_contract.layout import TableLayout
from gear_kernels import (
    CounterRng,
    Window,
    gather,
    gather_numpy,
    output_plan,
    scatter,
    twins,
    weighted_sample,
)
from gear_kernels import rng as krng
from tests.support.statistics import P_MIN, chi_square_p, counts

MASK = (1 << 64) - 1


def _splitmix_reference(seed: int, counter: int) -> int:
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    return mix((mix(seed) + (counter + 1) * 0x9E3779B97F4A7C15) & MASK)


def test_counter_rng_matches_plain_python_splitmix():
    seed, c0 = 0xDEADBEEF12345, 77
    state = krng.seed_state(seed)
    got = krng.random_u64(state, c0, 50)
    assert [int(x) for x in got] == [_splitmix_reference(seed, c0 + i) for i in range(50)]
    u = krng.random_unit(state, 0, 100_000)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01


def test_counter_rng_take_advances():
    r = CounterRng(5)
    assert r.take(10) == 0 and r.take(3) == 10 and r.counter == 13


def test_canonical_order_is_a_permutation_by_tiles():
    n = 2 * twins.SCAN_TILE + 77
    order = twins.canonical_order(n)
    assert sorted(order.tolist()) == list(range(n))
    assert order[:3].tolist() == [0, 256, 512]  # subtile 0 of tile 0: every 256th slot
    assert (order[: twins.SCAN_TILE] < twins.SCAN_TILE).all()


def test_tiled_scan_folds_in_canonical_order():
    w = np.random.default_rng(0).random(3 * twins.SCAN_TILE + 123)
    scan = twins.tiled_scan(w)
    order = twins.canonical_order(w.shape[0])
    for j in range(scan.nb):
        in_tile = order[(order >= j * twins.SCAN_TILE) & (order < (j + 1) * twins.SCAN_TILE)]
        np.testing.assert_allclose(scan.block_sum[j], w[in_tile].sum(), rtol=1e-12)
        incl = np.append(scan.sub_prefix[j, 1:], scan.block_sum[j])
        assert np.all(np.diff(incl) >= 0) and scan.sub_prefix[j, 0] == 0.0
        sub_sums = [w[in_tile[in_tile % 256 == m]].sum() for m in range(256)]  # subtile m: slots = m mod 256
        np.testing.assert_allclose(incl, np.cumsum(sub_sums), rtol=1e-12)
    np.testing.assert_allclose(scan.block_prefix[-1], w.sum(), rtol=1e-12)


def _table(n: int, seed: int, zero_fraction: float = 0.2, invalid_fraction: float = 0.2):
    g = np.random.default_rng(seed)
    priority = g.uniform(0.1, 3.0, n)
    priority[g.random(n) < zero_fraction] = 0.0
    valid = g.random(n) >= invalid_fraction
    return priority, valid


@pytest.mark.parametrize("exponent", [1.0, 0.6, 0.0, 2.5])
def test_prioritized_twin_distribution_and_probabilities(exponent):
    n, draws = 300, 400_000
    priority, valid = _table(n, 1)
    slots, probs = weighted_sample(priority, valid, draws, CounterRng(11), exponent=exponent)
    w = np.where(valid & (priority > 0), np.power(priority, exponent), 0.0)
    expected_p = w / w.sum()
    assert np.all(w[slots] > 0), "a zero-weight or invalid slot was drawn"
    np.testing.assert_allclose(probs, expected_p[slots], rtol=1e-12)
    live = expected_p > 0
    assert chi_square_p(counts(slots, n)[live], draws * expected_p[live]) >= P_MIN


def test_all_zero_weights_fall_back_to_uniform_over_valid():
    n, draws = 200, 200_000
    _, valid = _table(n, 2)
    priority = np.zeros(n)
    slots, probs = weighted_sample(priority, valid, draws, CounterRng(3), exponent=1.0)
    assert valid[slots].all()
    np.testing.assert_array_equal(probs, 1.0 / valid.sum())
    assert chi_square_p(counts(slots, n)[valid], np.full(valid.sum(), draws / valid.sum())) >= P_MIN


def test_uniform_twin_picks_the_kth_valid_slot_exactly():
    n, draws = 9000, 5000
    _, valid = _table(n, 4)
    r = CounterRng(9)
    state = r.state
    slots, probs = weighted_sample(None, valid, draws, r, uniform=True)
    u = krng.random_unit(state, 0, draws)
    idx = np.floor(u * valid.sum()).astype(np.int64)
    order = twins.canonical_order(n)
    np.testing.assert_array_equal(slots, order[valid[order]][idx])
    np.testing.assert_array_equal(probs, 1.0 / valid.sum())


def test_same_seed_same_selection_and_counter_moves_on():
    priority, valid = _table(5000, 5)
    a = weighted_sample(priority, valid, 64, CounterRng(123), exponent=0.7)
    b = weighted_sample(priority, valid, 64, CounterRng(123), exponent=0.7)
    np.testing.assert_array_equal(a[0], b[0])
    r = CounterRng(123)
    weighted_sample(priority, valid, 64, r, exponent=0.7)
    c = weighted_sample(priority, valid, 64, r, exponent=0.7)
    assert not np.array_equal(a[0], c[0])


def test_no_valid_slot_gives_minus_one():
    slots, probs = weighted_sample(np.ones(10), np.zeros(10, bool), 4, CounterRng(1))
    np.testing.assert_array_equal(slots, -1)
    np.testing.assert_array_equal(probs, 0.0)



def test_scatter_last_entry_wins():
    priority = np.zeros(8)
    update_seq = np.zeros(8, np.int64)
    slots = np.array([1, 5, 1, 7, 5])
    scatter(slots, {"priority": priority, "update_seq": update_seq},
            {"priority": [1.0, 2.0, 3.0, 4.0, 5.0], "update_seq": [10, 11, 12, 13, 14]})
    assert priority.tolist() == [0, 3.0, 0, 0, 0, 5.0, 0, 4.0]
    assert update_seq.tolist() == [0, 12, 0, 0, 0, 14, 0, 13]
    with pytest.raises(ValueError, match="unknown fields"):
        scatter(slots, {"prio": priority}, {"prio": priority})


# ---------------------------------------------------------------------------- gather twin

def _layout(capacity: int, segment: str = "") -> TableLayout:
    return TableLayout.build("t", segment, capacity, [
        ("obs", np.float32, (3,), 9, False),  # 12-byte steps: unaligned windows
        ("tag", np.uint8, (5,), 4, False),  # 5-byte steps
        ("pair", np.float64, (7, 2), 6, False),
        ("r", np.int16, (), 1, True),
        ("big", np.uint8, (4096,), 3, False),
    ])


def _segment(layout: TableLayout, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, layout.segment_size, dtype=np.uint8)


def _expected_rows(layout, seg, c, slots, lengths, window: Window):
    col = layout.columns[c]
    view = layout.column_view(seg, c)
    W = window.length or col.max_length
    rows = np.zeros((len(slots), W, *col.shape), dtype=col.dtype)
    nvalid = np.zeros(len(slots), np.int32)
    starts = np.broadcast_to(np.asarray(window.start), (len(slots),))
    for b, slot in enumerate(slots):
        L = int(min(max(lengths[b, c], 0), col.max_length))
        s = int(starts[b])
        s0 = s if s >= 0 else L + s
        steps = [t for t in range(s0, s0 + W) if 0 <= t < L]
        nvalid[b] = len(steps)
        at = W - len(steps) if window.pad == "head" else 0
        for i, t in enumerate(steps):
            rows[b, at + i] = view[slot, t]
    return rows, nvalid


def _windows_under_test(batch: int, g: np.random.Generator):
    return [
        Window(),
        Window(length=4, start=-4, pad="head"),
        Window(length=5, start=1, pad="tail"),
        Window(length=2, start=g.integers(-3, 4, batch), pad="head"),
        Window(length=7, start=-7, pad="tail"),
    ]


def test_gather_twin_matches_step_by_step_reference():
    layout = _layout(40)
    seg = _segment(layout, 1)
    g = np.random.default_rng(2)
    batch = 23
    slots = g.integers(0, layout.capacity, batch)
    lengths = np.stack([g.integers(0, c.max_length + 1, batch) for c in layout.columns], axis=1).astype(np.int32)
    lengths[0, :] = 999  # over max_length: clamped
    windows = _windows_under_test(batch, g)
    _, total = output_plan(layout, batch, windows=windows)
    out = np.full(total, 0xA5, dtype=np.uint8)  # poisoned: padding must be written
    got = gather_numpy(layout, seg, slots, lengths, windows, out=out)
    for c in range(len(layout.columns)):
        rows, nvalid = _expected_rows(layout, seg, c, slots, lengths, windows[c])
        assert got.columns[c].shape == rows.shape
        np.testing.assert_array_equal(got.columns[c].view(np.uint8), rows.view(np.uint8))
        np.testing.assert_array_equal(got.lengths[:, c], nvalid)


def test_gather_without_registration_reads_an_mmap_through_the_twin():
    layout = _layout(8)
    seg = _segment(layout, 3)
    mm = mmap.mmap(-1, layout.segment_size)
    mm[:] = seg.tobytes()
    slots = np.array([7, 0, 3])
    lengths = np.tile([[9, 4, 6, 1, 3]], (3, 1)).astype(np.int32)
    got = gather(layout, mm, slots, lengths, columns=[4, 0])
    assert got.column_indices == (4, 0)
    np.testing.assert_array_equal(got.columns[0], layout.column_view(seg, 4)[slots])
    np.testing.assert_array_equal(got.columns[1].view(np.uint8), layout.column_view(seg, 0)[slots].view(np.uint8))
    del got
    mm.close()


def test_gather_rejects_bad_input():
    layout = _layout(4)
    seg = _segment(layout, 4)
    lengths = np.ones((2, 5), np.int32)
    with pytest.raises(ValueError, match="slots must lie"):
        gather_numpy(layout, seg, [0, 4], lengths)
    with pytest.raises(ValueError, match="lengths must have shape"):
        gather_numpy(layout, seg, [0, 1], np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="pad"):
        Window(pad="middle")
    with pytest.raises(ValueError, match="segment holds"):
        gather_numpy(layout, seg[:100], [0, 1], lengths)
    with pytest.raises(ValueError, match="windows for"):
        gather_numpy(layout, seg, [0, 1], lengths, [Window()] * 2)
