"""Every GPU kernel against its NumPy twin, on fresh random inputs (needs a GPU; skipped without one).

Device outputs come from poisoned allocations (conftest.cupy), so an element
a kernel fails to write shows up as a mismatch. Sampling is compared exactly
where the arithmetic is the same (exponent 0 or 1, uniform, the all-zero
fallback) and by distribution otherwise (chi-square, P_MIN in tests/support/statistics.py).
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest

from gear_contract.layout import ColumnLayout, TableLayout
from gear_kernels import (
    CounterRng,
    HostRegistration,
    Window,
    gather,
    gather_numpy,
    output_plan,
    scatter,
    selection,
    to_jax,
    to_torch,
    weighted_sample,
)
from tests.support.statistics import P_MIN, chi_square_p, counts

pytestmark = pytest.mark.gpu

POISON = 0xA5


def _meta(n: int, seed: int, *, ties: bool = False, zero_fraction: float = 0.1, invalid_fraction: float = 0.2):
    g = np.random.default_rng(seed)
    priority = g.choice([0.0, 0.25, 1.0, 3.0], n) if ties else g.uniform(0.05, 4.0, n)
    priority[g.random(n) < zero_fraction] = 0.0
    valid = g.random(n) >= invalid_fraction
    insert_seq = g.permutation(n).astype(np.int64)
    update_seq = g.permutation(n).astype(np.int64) + n
    return priority, valid, insert_seq, update_seq


SIZES = [1, 7, 4095, 4096, 4097, 100_003, 1 << 20]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("exponent", [1.0, 0.0])
def test_prioritized_matches_twin_exactly(cupy, n, exponent):
    priority, valid, _, _ = _meta(n, n + 1)
    valid[0] = True
    priority[0] = 0.5
    batch = 4099
    d_slots, d_probs = weighted_sample(cupy.asarray(priority), cupy.asarray(valid), batch, CounterRng(n),
                                       exponent=exponent)
    h_slots, h_probs = weighted_sample(priority, valid, batch, CounterRng(n), exponent=exponent)
    np.testing.assert_array_equal(d_slots.get(), h_slots)
    np.testing.assert_array_equal(d_probs.get(), h_probs)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("n", [1, 4097, 1 << 20])
def test_uniform_and_zero_fallback_match_twin_exactly(cupy, monkeypatch, n, graphs):
    monkeypatch.setattr(selection, "USE_GRAPHS", graphs)
    priority, valid, _, _ = _meta(n, 3 * n)
    valid[-1] = True
    for uniform, prio in ((True, priority), (False, np.zeros(n))):
        d = weighted_sample(cupy.asarray(prio), cupy.asarray(valid), 1000, CounterRng(4), uniform=uniform,
                            host=True)
        h = weighted_sample(prio, valid, 1000, CounterRng(4), uniform=uniform)
        np.testing.assert_array_equal(d[0], h[0])
        np.testing.assert_array_equal(d[1], h[1])


def test_no_valid_slot_gives_minus_one(cupy):
    d_slots, d_probs = weighted_sample(cupy.ones(5000), cupy.zeros(5000, dtype=bool), 300, CounterRng(1))
    assert (d_slots.get() == -1).all() and (d_probs.get() == 0).all()


def test_prioritized_distribution_with_pow(cupy):
    """exponent 0.6 (pow may differ from NumPy's by an ulp): nearly all draws agree, and the law holds."""
    n, draws = 2000, 1 << 21
    priority, valid, _, _ = _meta(n, 99)
    d_slots, d_probs = weighted_sample(cupy.asarray(priority), cupy.asarray(valid), draws, CounterRng(5),
                                       exponent=0.6, host=True)
    h_slots, _ = weighted_sample(priority, valid, draws, CounterRng(5), exponent=0.6)
    assert np.mean(d_slots == h_slots) > 0.9999
    w = np.where(valid & (priority > 0), priority ** 0.6, 0.0)
    p = w / w.sum()
    assert (w[d_slots] > 0).all()
    np.testing.assert_allclose(d_probs, p[d_slots], rtol=1e-12)
    live = p > 0
    assert chi_square_p(counts(d_slots, n)[live], draws * p[live]) >= P_MIN


def test_same_seed_same_selection_on_gpu(cupy):
    priority, valid, _, _ = _meta(300_000, 7)
    dp, dv = cupy.asarray(priority), cupy.asarray(valid)
    a = weighted_sample(dp, dv, 4096, CounterRng(77), exponent=0.8, host=True)
    b = weighted_sample(dp, dv, 4096, CounterRng(77), exponent=0.8, host=True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("graphs", [True, False])
def test_scatter_matches_twin(cupy, monkeypatch, graphs):
    monkeypatch.setattr(selection, "USE_GRAPHS", graphs)
    n = 1 << 20
    g = np.random.default_rng(12)
    for k in (4096, 4096, 70_000):  # fresh epochs (older claims never win); one launch, then two
        priority, valid, insert_seq, update_seq = _meta(n, int(g.integers(1 << 30)))
        ts = g.integers(0, 5, n).astype(np.int32)
        slots = g.integers(0, n, k)
        slots[: k // 8] = slots[k // 8: k // 4]  # duplicates: the last entry wins
        values = {"priority": g.random(k), "update_seq": g.integers(0, 1 << 40, k), "valid": g.random(k) < 0.5,
                  "times_sampled": g.integers(0, 9, k).astype(np.int32)}
        host = {"priority": priority.copy(), "update_seq": update_seq.copy(), "valid": valid.copy(),
                "times_sampled": ts.copy()}
        dev = {name: cupy.asarray(a) for name, a in host.items()}
        scatter(slots, dev, values)
        scatter(slots, host, values)
        for name in host:
            np.testing.assert_array_equal(dev[name].get(), host[name])


# ---------------------------------------------------------------------------- gather

def _shm_segment(nbytes: int, seed: int):
    """A real shared-memory segment (a file under /dev/shm), mapped, filled with random bytes."""
    fd, path = tempfile.mkstemp(prefix="gear-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    os.unlink(path)
    np.frombuffer(mm, dtype=np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return mm


def _compare_gather(cupy, layout, mm, registration, slots, lengths, windows, columns=None):
    batch = len(slots)
    _, total = output_plan(layout, batch, columns, windows)
    out = cupy.full(total + 512, POISON, dtype=cupy.uint8)
    got = gather(layout, registration, slots, lengths, windows, columns=columns, out=out)
    want = gather_numpy(layout, mm, slots, lengths, windows, columns=columns)
    offsets, _ = output_plan(layout, batch, columns, windows)
    for i, c in enumerate(got.column_indices):
        col = layout.columns[c]
        assert got.columns[i].shape == want.columns[i].shape
        assert got.columns[i].dtype == col.dtype
        nbytes = want.columns[i].nbytes
        np.testing.assert_array_equal(out[offsets[i]:offsets[i] + nbytes].get(),
                                      want.columns[i].reshape(-1).view(np.uint8))
    np.testing.assert_array_equal(got.lengths.get(), want.lengths)
    assert (out[total:].get() == POISON).all(), "the kernel wrote past the batch"
    return got


def _odd_layout(capacity: int) -> TableLayout:
    return TableLayout.build("t", "", capacity, [
        ("obs", np.float32, (3,), 9, False),
        ("tag", np.uint8, (5,), 4, False),
        ("pair", np.float64, (7, 2), 6, False),
        ("r", np.int16, (), 1, True),
        ("big", np.uint8, (4096 + 3,), 3, False),
        ("img", np.uint8, (64, 64), 2, False),
    ])


@pytest.mark.parametrize("batch", [1, 37, 256])
def test_gather_matches_twin_byte_for_byte(cupy, batch):
    layout = _odd_layout(300)
    mm = _shm_segment(layout.segment_size, batch)
    g = np.random.default_rng(batch)
    with HostRegistration(mm) as reg:
        for _ in range(3):
            slots = g.integers(0, layout.capacity, batch)
            lengths = np.stack([g.integers(0, c.max_length + 2, batch) for c in layout.columns], 1).astype(np.int32)
            windows = [
                Window(),
                Window(length=4, start=-4, pad="head"),
                Window(length=5, start=int(g.integers(0, 3)), pad="tail"),
                Window(length=3, start=g.integers(-3, 3, batch), pad="head"),
                Window(length=2, start=1, pad="tail"),
                Window(length=3, start=-1, pad="head"),
            ]
            _compare_gather(cupy, layout, mm, reg, slots, lengths, windows)
            _compare_gather(cupy, layout, mm, reg, slots, lengths, [windows[4], windows[0]], columns=[4, 0])
            # device slots and lengths (the selection kernels' output) take the same path
            got = gather(layout, reg, cupy.asarray(slots), cupy.asarray(lengths), windows)
            want = gather_numpy(layout, mm, slots, lengths, windows)
            for a, b in zip(got.columns, want.columns, strict=True):
                np.testing.assert_array_equal(a.get().view(np.uint8), b.view(np.uint8))
    del reg
    mm.close()


def test_gather_unaligned_columns(cupy):
    """Column offsets and slot strides that are not multiples of 16 (outside TableLayout's guarantee)."""
    capacity = 50
    cols = (
        ColumnLayout("a", np.dtype(np.uint8), (37,), offset=3, slot_stride=37 * 5 + 1, max_length=5),
        ColumnLayout("b", np.dtype(np.int32), (3,), offset=3 + 50 * 186 + 5, slot_stride=12 * 7 + 4, max_length=7),
        ColumnLayout("c", np.dtype(np.uint8), (1000,), offset=20_000, slot_stride=1000 * 4 + 9, max_length=4),
    )
    layout = TableLayout("t", "", capacity, cols)
    mm = _shm_segment(layout.segment_size + 4096, 5)
    g = np.random.default_rng(6)
    with HostRegistration(mm) as reg:
        for batch in (1, 19, 64):
            slots = g.integers(0, capacity, batch)
            lengths = np.stack([g.integers(0, c.max_length + 1, batch) for c in cols], 1).astype(np.int32)
            windows = [Window(length=3, start=g.integers(-5, 5, batch), pad="head"),
                       Window(length=6, start=1), Window(start=-3, length=3, pad="head")]
            _compare_gather(cupy, layout, mm, reg, slots, lengths, windows)
    del reg
    mm.close()


def test_gather_from_table_over_4_gib(cupy):
    """Slots past 4 GiB: 64-bit offsets all the way (only the selected slots are filled)."""
    item = 1 << 20
    capacity = 4608 + 64
    layout = TableLayout.build("big", "", capacity, [("x", np.uint8, (item,), 1, False),
                                                    ("y", np.float32, (5,), 3, False)])
    assert layout.segment_size > (4 << 30) + (64 << 20)
    mm = mmap.mmap(-1, layout.segment_size)
    seg = np.frombuffer(mm, dtype=np.uint8)
    g = np.random.default_rng(7)
    slots = np.concatenate([g.integers(4200, 4608 + 64, 30), [0, capacity - 1]])
    for s in slots:
        for col in layout.columns:
            at = col.offset + int(s) * col.slot_stride
            seg[at:at + col.slot_stride] = g.integers(0, 256, col.slot_stride, dtype=np.uint8)
    assert layout.columns[0].slot_offset(int(slots.max())) >= 4 << 30
    lengths = np.stack([np.ones(len(slots)), g.integers(0, 4, len(slots))], 1).astype(np.int32)
    with HostRegistration(mm) as reg:
        _compare_gather(cupy, layout, mm, reg, slots, lengths, [Window(), Window(length=3, start=-3, pad="head")])
    del seg, reg
    mm.close()


def test_gather_out_of_range_slot(cupy):
    layout = _odd_layout(10)
    mm = _shm_segment(layout.segment_size, 8)
    lengths = np.ones((2, len(layout.columns)), np.int32)
    with HostRegistration(mm) as reg:
        with pytest.raises(ValueError, match="slots must lie"):
            gather(layout, reg, np.array([0, 10]), lengths)
        got = gather(layout, reg, cupy.asarray(np.array([0, 10])), cupy.asarray(lengths))
        assert (got.lengths.get()[1] == -1).all()
        assert (got.columns[0][1].get() == 0).all()
    del reg
    mm.close()


def test_batches_reach_torch_and_jax_without_a_copy(cupy):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    layout = _odd_layout(20)
    mm = _shm_segment(layout.segment_size, 9)
    slots = np.arange(8)
    lengths = np.tile([[9, 4, 6, 1, 3, 2]], (8, 1)).astype(np.int32)
    with HostRegistration(mm) as reg:
        got = gather(layout, reg, slots, lengths)
        col = got.columns[2]
        torch = pytest.importorskip("torch")
        t = to_torch(col)
        assert t.data_ptr() == col.data.ptr and tuple(t.shape) == col.shape and t.dtype == torch.float64
        np.testing.assert_array_equal(t.cpu().numpy(), col.get())
        jax = pytest.importorskip("jax")
        obs = got.columns[0]  # float32: JAX's default dtypes
        j = to_jax(obs)
        assert j.unsafe_buffer_pointer() == obs.data.ptr and j.shape == obs.shape
        np.testing.assert_array_equal(np.asarray(jax.device_get(j)).view(np.uint8), obs.get().view(np.uint8))
        if not jax.config.jax_enable_x64:
            with pytest.raises(ValueError, match="jax_enable_x64"):
                to_jax(col)
    del reg
    mm.close()
