"""Selectors: Reverb's probabilities, orders and tie-breaks; distributions by chi-square."""

from __future__ import annotations

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors import Fifo, Lifo, MaxHeap, MinHeap, Prioritized, Uniform, make_selector
from gear_server.table.selectors.prioritized import block_size_for
from tests.support.statistics import chi2_critical, chi2_statistic


def rng(seed=0):
    return np.random.default_rng(seed)


def fill(sel, priorities, start_seq=1, slots=None):
    slots = list(range(len(priorities))) if slots is None else slots
    for i, (slot, p) in enumerate(zip(slots, priorities, strict=True)):
        sel.insert(slot, p, start_seq + i)
    return slots


def test_factory_builds_each_kind_and_rejects_none():
    assert isinstance(make_selector(pb.SelectorOptions(uniform=True), 4), Uniform)
    p = make_selector(pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.7)), 4)
    assert isinstance(p, Prioritized) and p.exponent == 0.7
    assert isinstance(make_selector(pb.SelectorOptions(fifo=True), 4), Fifo)
    assert isinstance(make_selector(pb.SelectorOptions(lifo=True), 4), Lifo)
    h = make_selector(pb.SelectorOptions(heap=pb.HeapOptions(min_heap=True)), 4)
    assert h.min_heap and h.options.heap.min_heap
    assert not make_selector(pb.SelectorOptions(heap=pb.HeapOptions()), 4).min_heap
    with pytest.raises(ValueError, match="distribution"):
        make_selector(pb.SelectorOptions(), 4)
    with pytest.raises(ValueError, match="exponent"):
        make_selector(pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=-1)), 4)


def test_uniform_probability_and_distribution():
    sel = Uniform(64)
    slots = fill(sel, [1.0] * 10, slots=list(range(0, 50, 5)))
    sel.delete(20)  # 9 left
    picked, probs = sel.sample(90_000, rng(1))
    assert np.all(probs == 1 / 9)
    live = [s for s in slots if s != 20]
    assert set(picked.tolist()) == set(live)
    counts = np.array([np.count_nonzero(picked == s) for s in live])
    assert chi2_statistic(counts, np.full(9, 1 / 9)) < chi2_critical(8)


def test_empty_selector_refuses_to_pick():
    for sel in (Uniform(4), Prioritized(4, priority_exponent=1.0), Fifo(4), Lifo(4), MaxHeap(4), MinHeap(4)):
        with pytest.raises(RuntimeError):
            sel.sample(1, rng())


@pytest.mark.parametrize("capacity", [16, 100_000])  # one block / many blocks of the two-level sum tree
def test_prioritized_probabilities_and_distribution(capacity):
    sel = Prioritized(capacity, priority_exponent=0.8)
    priorities = [0.5, 1.0, 2.0, 4.0, 0.0, 8.0, 3.0]
    spread = max(1, capacity // 7 - 1)
    slots = [i * spread for i in range(len(priorities))]  # spread over blocks
    fill(sel, priorities, slots=slots)
    w = np.array([p ** 0.8 if p > 0 else 0.0 for p in priorities])
    expect = w / w.sum()
    picked, probs = sel.sample(200_000, rng(2))
    index = {s: i for i, s in enumerate(slots)}
    idx = np.array([index[s] for s in picked.tolist()])
    np.testing.assert_allclose(probs, expect[idx], rtol=1e-12)
    counts = np.bincount(idx, minlength=len(slots))
    assert counts[4] == 0  # priority 0 never picked
    nz = expect > 0
    assert chi2_statistic(counts[nz], expect[nz]) < chi2_critical(int(nz.sum()) - 1)


def test_prioritized_zero_priority_has_zero_weight_even_for_exponent_zero():
    sel = Prioritized(8, priority_exponent=0.0)
    fill(sel, [0.0, 5.0, 2.0])
    picked, probs = sel.sample(5000, rng(3))
    assert 0 not in picked.tolist()
    assert np.all(probs == 0.5)


def test_prioritized_all_zero_falls_back_to_uniform():
    sel = Prioritized(8, priority_exponent=1.0)
    fill(sel, [0.0, 0.0, 0.0, 0.0])
    picked, probs = sel.sample(40_000, rng(4))
    assert np.all(probs == 0.25)
    counts = np.bincount(picked, minlength=4)
    assert chi2_statistic(counts, np.full(4, 0.25)) < chi2_critical(3)


def test_prioritized_updates_and_deletes_change_distribution():
    sel = Prioritized(5000, priority_exponent=1.0)
    fill(sel, [1.0] * 5000)
    sel.update_many(np.arange(0, 5000, 2), np.zeros(2500), np.arange(2500))  # evens -> weight 0
    for s in range(1, 5000, 4):
        sel.delete(s)  # a quarter gone
    picked, probs = sel.sample(20_000, rng(5))
    assert np.all(picked % 4 == 3)
    np.testing.assert_allclose(probs, 1 / 1250)
    sel.update(3, 1249.0, 99)  # now item 3 holds half the mass (1249 of 2498)
    picked, probs = sel.sample(20_000, rng(6))
    share = np.mean(picked == 3)
    assert abs(share - 0.5) < 0.02
    assert probs[picked == 3][0] == pytest.approx(0.5)


def test_prioritized_batched_updates_keep_the_mass_exact_however_their_block_sums_are_deferred(monkeypatch):
    """update_many leaves block sums to the next read; a single update, a delete, a resize and the
    fold past STALE_SLOTS_MAX in between never leave a stale sum behind."""
    import gear_server.table.selectors.prioritized as prioritized

    monkeypatch.setattr(prioritized, "STALE_SLOTS_MAX", 300)
    sel = Prioritized(4000, priority_exponent=0.5)
    fill(sel, [4.0] * 4000)
    gen = rng(8)
    want = np.full(4000, 2.0)  # weights 4 ** 0.5
    for step in range(40):
        slots = gen.choice(4000, 64, replace=False)
        prios = gen.uniform(0, 9, 64)
        sel.update_many(slots, prios, np.arange(64) + 100 * step)
        want[slots] = prios ** 0.5
        if step % 7 == 3:
            sel.update(int(slots[0]), 16.0, 10_000 + step)
            want[slots[0]] = 4.0
        if step % 11 == 5:
            sel.delete(int(slots[1]))
            want[slots[1]] = 0.0
        if step % 5 == 0:
            assert sel.total_weight() == pytest.approx(want.sum())
    sel.resize(8000)
    assert sel.total_weight() == pytest.approx(want.sum())
    picked, probs = sel.sample(5000, rng(9))
    np.testing.assert_allclose(probs, want[picked] / want.sum())


def test_prioritized_resize_keeps_weights():
    sel = Prioritized(16, priority_exponent=1.0)
    fill(sel, [1.0, 3.0])
    sel.resize(10_000)
    assert sel.block == block_size_for(10_000)
    sel.insert(9000, 4.0, 3)
    picked, probs = sel.sample(1000, rng(7))
    np.testing.assert_allclose(sorted({round(p, 6) for p in probs}), [0.125, 0.375, 0.5])


def test_fifo_and_lifo_order_by_insertion_ignoring_updates():
    fifo, lifo = Fifo(16), Lifo(16)
    for sel in (fifo, lifo):
        fill(sel, [5.0, 1.0, 9.0, 2.0], slots=[7, 3, 11, 0])
        sel.update(3, 100.0, 50)  # a priority update does not move an item
    assert fifo.sample(3, rng())[0].tolist() == [7, 7, 7]
    assert fifo.sample(1, rng())[1].tolist() == [1.0]
    assert lifo.sample(1, rng())[0].tolist() == [0]
    fifo.delete(7)
    lifo.delete(0)
    assert fifo.pick_one(rng()) == 3 and lifo.pick_one(rng()) == 11
    fifo.delete(11)  # middle delete: lazily skipped
    fifo.delete(3)
    assert fifo.pick_one(rng()) == 0
    lifo.insert(0, 1.0, 60)
    assert lifo.pick_one(rng()) == 0


def test_insertion_order_compacts_stale_entries():
    sel = Fifo(4096)
    for i in range(3000):
        sel.insert(i, 1.0, i + 1)
    for i in range(1, 2999):  # delete the middle: entries go stale without reaching an end
        sel.delete(i)
    assert len(sel) == 2
    assert len(sel._entries) <= 2 * len(sel) + sel._COMPACT_SLACK
    assert sel.pick_one(rng()) == 0
    sel.delete(0)
    assert sel.pick_one(rng()) == 2999


def test_heaps_pick_extremes_and_break_ties_by_least_recent():
    mx, mn = MaxHeap(16), MinHeap(16)
    for sel in (mx, mn):
        fill(sel, [3.0, 7.0, 7.0, 1.0, 1.0])  # seqs 1..5
    assert mx.pick_one(rng()) == 1  # 7.0 inserted before slot 2
    assert mn.pick_one(rng()) == 3  # 1.0 inserted before slot 4
    mx.update(1, 7.0, 10)  # re-set to the same value: now most recently updated
    assert mx.pick_one(rng()) == 2
    mn.update(3, 1.0, 11)
    assert mn.pick_one(rng()) == 4
    mx.update(0, 100.0, 12)
    assert mx.sample(2, rng())[0].tolist() == [0, 0]
    assert mx.sample(1, rng())[1].tolist() == [1.0]
    mx.delete(0)
    assert mx.pick_one(rng()) == 2
    mn.delete(4)
    assert mn.pick_one(rng()) == 3


def test_heap_lazy_entries_compact():
    sel = MaxHeap(8)
    sel.insert(0, 1.0, 1)
    for i in range(5000):
        sel.update(0, float(i % 7), i + 2)
    assert len(sel._entries) <= 2 * len(sel) + sel._COMPACT_SLACK
    assert sel.pick_one(rng()) == 0


def test_restore_rebuilds_same_choices():
    pri = [2.0, 9.0, 9.0, 0.5, 4.0]
    slots = np.array([4, 0, 2, 3, 1], np.int64)
    ins = np.array([1, 2, 3, 4, 5], np.int64)
    upd = np.array([7, 2, 3, 4, 6], np.int64)
    for kind in ("uniform", "fifo", "lifo", "max_heap", "min_heap", "prioritized"):
        opts = {"uniform": pb.SelectorOptions(uniform=True), "fifo": pb.SelectorOptions(fifo=True),
                "lifo": pb.SelectorOptions(lifo=True),
                "max_heap": pb.SelectorOptions(heap=pb.HeapOptions(min_heap=False)),
                "min_heap": pb.SelectorOptions(heap=pb.HeapOptions(min_heap=True)),
                "prioritized": pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=1.0))}[kind]
        a = make_selector(opts, 8)
        for s, p, q in zip(slots.tolist(), pri, ins.tolist(), strict=True):
            a.insert(s, p, q)
        for s, p, q in zip(slots.tolist(), pri, upd.tolist(), strict=True):
            if q != 0 and q not in ins.tolist():
                a.update(s, p, q)
        b = make_selector(opts, 8)
        b.restore(slots, np.array(pri), ins, upd, a.snapshot())
        ra, rb = a.sample(50, rng(9)), b.sample(50, rng(9))
        assert ra[0].tolist() == rb[0].tolist(), kind
        np.testing.assert_allclose(ra[1], rb[1])


def test_million_items_sanity():
    """1M items: bulk restore, O(1)/O(log N) removals, batched prioritized picks (no timing asserted)."""
    n = 1_000_000
    slots = np.arange(n, dtype=np.int64)
    pri = np.random.default_rng(0).random(n) + 0.1
    seqs = np.arange(1, n + 1, dtype=np.int64)
    p = Prioritized(n + 64, priority_exponent=1.0)
    p.restore(slots, pri, seqs, seqs, {})
    picked, probs = p.sample(256, rng())
    np.testing.assert_allclose(probs, pri[picked] / pri.sum(), rtol=1e-9)
    fifo = Fifo(n + 64)
    fifo.restore(slots, pri, seqs, seqs, {})
    for i in range(1000):  # a full table's remover: pick oldest + delete
        s = fifo.pick_one(rng())
        assert s == i
        fifo.delete(s)
    heap = MinHeap(n + 64)
    heap.restore(slots, pri, seqs, seqs, {})
    order = np.argsort(pri, kind="stable")
    for i in range(1000):
        s = heap.pick_one(rng())
        assert s == order[i]
        heap.delete(s)
    uni = Uniform(n + 64)
    uni.restore(slots, pri, seqs, seqs, {})
    assert len(uni) == n and uni.sample(10, rng())[0].max() < n
