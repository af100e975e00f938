"""Batched picks counted as Reverb's one-by-one samples, and the prioritized picks that feed them."""

from __future__ import annotations

import numpy as np
import pytest

from gear_server.table.picks import count_picks, find_repeats, held_of
from gear_server.table.selectors import Prioritized, Uniform
from gear_server.table.slots import ItemMetadata, SlotBook
from tests.support.statistics import chi2_critical, chi2_statistic
from tests.support.tables import item, make_table


def prioritized(weights_by_slot: dict[int, float], capacity: int) -> Prioritized:
    sel = Prioritized(capacity, priority_exponent=1.0)
    for seq, (slot, w) in enumerate(weights_by_slot.items()):
        sel.insert(slot, w, seq + 1)
    return sel


def one_by_one(times_before: np.ndarray, slots: np.ndarray, mts: int) -> tuple[list[int], int, bool]:
    """Reverb's semantics, one pick at a time: (times reported, first samples, last pick deletes)."""
    times = times_before.copy()
    reported, first = [], 0
    for s in slots.tolist():
        first += times[s] == 0
        times[s] += 1
        reported.append(int(times[s]))
        if mts and times[s] >= mts:
            return reported, first, True
    return reported, first, False


# ------------------------------------------------------------------ prioritized picks
def test_prioritized_repeats_are_the_picks_of_repeated_slots_grouped_and_ascending():
    sel = prioritized({s: float(1 + s % 5) for s in range(0, 300, 3)}, 400)
    for seed in range(5):
        slots, probs, repeats = sel.sample_with_repeats(5000, np.random.default_rng(seed))
        assert repeats is not None and len(repeats) > 0
        np.testing.assert_array_equal(repeats, find_repeats(slots))
        np.testing.assert_allclose(probs, (1 + slots % 5) / sel.total_weight(), rtol=1e-12)
    distinct = prioritized({s: 1.0 for s in range(100_000)}, 100_000)
    slots, _, repeats = distinct.sample_with_repeats(8, np.random.default_rng(0))
    assert repeats is not None and len(repeats) == len(find_repeats(slots))


def test_prioritized_picks_come_in_random_order_not_sorted():
    """The structure searches sorted targets; what it returns must be as random as independent draws."""
    sel = prioritized({s: 1.0 + s for s in range(1000)}, 1024)
    slots, _, _ = sel.sample_with_repeats(20_000, np.random.default_rng(1))
    ups = np.count_nonzero(slots[1:] > slots[:-1])
    downs = np.count_nonzero(slots[1:] < slots[:-1])
    assert abs(ups - downs) < 0.05 * (ups + downs)
    # where the heaviest slot's picks fall: uniform over the positions of the batch (10 bins)
    where = np.flatnonzero(slots >= 900) * 10 // len(slots)
    counts = np.bincount(where, minlength=10)
    assert chi2_statistic(counts, np.full(10, 0.1)) < chi2_critical(9)


@pytest.mark.parametrize("capacity", [64, 5000, 300_000])
def test_prioritized_distribution_over_sparse_blocks_and_wide_weights(capacity):
    """Weights over 12 orders of magnitude, zeros inside blocks and whole empty blocks, the last slot used."""
    gen = np.random.default_rng(capacity)
    slots = np.unique(np.concatenate([gen.choice(capacity, 40, replace=False), [capacity - 1]]))
    weights = 10.0 ** gen.uniform(-6, 6, len(slots))
    weights[::7] = 0.0
    sel = prioritized(dict(zip(slots.tolist(), weights.tolist(), strict=True)), capacity)
    picked, probs = sel.sample(400_000, np.random.default_rng(2))
    index = {s: i for i, s in enumerate(slots.tolist())}
    idx = np.array([index[s] for s in picked.tolist()])
    expect = weights / weights.sum()
    np.testing.assert_allclose(probs, expect[idx], rtol=1e-12)
    counts = np.bincount(idx, minlength=len(slots))
    assert counts[weights == 0].sum() == 0
    big = expect * len(picked) >= 5  # chi-square where the expected counts allow it; the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expect[big], expect[~big].sum())
    keep = expected > 0
    assert chi2_statistic(observed[keep], expected[keep]) < chi2_critical(int(keep.sum()) - 1)


def test_prioritized_one_weighted_slot_among_many_empty_ones_is_the_only_pick():
    for slot in (0, 4095, 99_999):
        sel = Prioritized(100_000, priority_exponent=1.0)
        sel.insert(slot, 1e-300, 1)
        for other in (1, 50_000):
            if other != slot:
                sel.insert(other, 0.0, 2)
        picked, probs = sel.sample(3000, np.random.default_rng(slot))
        assert set(picked.tolist()) == {slot}
        np.testing.assert_allclose(probs, 1.0)


def test_prioritized_same_seed_same_picks():
    a = prioritized({s: 0.5 + s % 11 for s in range(5000)}, 6000)
    b = prioritized({s: 0.5 + s % 11 for s in range(5000)}, 6000)
    for n in (1, 7, 4096):
        ra, rb = a.sample_with_repeats(n, np.random.default_rng(n)), b.sample_with_repeats(n, np.random.default_rng(n))
        for x, y in zip(ra, rb, strict=True):
            np.testing.assert_array_equal(x, y)


def test_prioritized_updates_refresh_running_sums_before_the_next_pick():
    """update_many defers block sums; picks right after must follow the new weights (and never a zeroed slot)."""
    sel = prioritized({s: 1.0 for s in range(4096)}, 4096)
    sel.update_many(np.arange(0, 4096, 2), np.zeros(2048), np.arange(2048))
    sel.update_many(np.array([1, 3]), np.array([1000.0, 3000.0]), np.array([5000, 5001]))
    picked, probs = sel.sample(50_000, np.random.default_rng(3))
    assert np.all(picked % 2 == 1)
    total = 2046 + 4000.0
    assert abs(np.mean(picked == 3) - 3000 / total) < 0.01
    np.testing.assert_allclose(probs[picked == 1], 1000 / total)


# ------------------------------------------------------------------ counting
@pytest.mark.parametrize("mts", [0, 1, 2, 3, 6])
@pytest.mark.parametrize("known", [True, False])
def test_count_picks_matches_one_by_one_samples(mts, known):
    gen = np.random.default_rng(mts * 2 + known)
    for _ in range(30):
        capacity = 40
        meta = ItemMetadata(capacity, 1)
        meta.times_sampled[:] = gen.integers(0, 3, capacity) if not mts else gen.integers(0, max(mts - 1, 1), capacity)
        meta.key[:] = np.arange(capacity, dtype=np.uint64) + 100
        meta.priority[:] = gen.random(capacity)
        meta.generation[:] = gen.integers(1, 9, capacity)
        before = meta.times_sampled.copy()
        slots = gen.integers(0, capacity, int(gen.integers(1, 60)))
        probs = gen.random(len(slots))
        want, want_first, want_delete = one_by_one(before, slots, mts)
        picks = count_picks(meta, slots, probs, mts, 33, find_repeats(slots) if known else None)
        n = len(want)
        got_slots, keys, got_probs, sizes, priorities, times, generations = picks.chunk
        assert times.tolist() == want and got_slots.tolist() == slots[:n].tolist()
        assert keys.tolist() == (slots[:n] + 100).tolist() and got_probs.tolist() == probs[:n].tolist()
        assert sizes.tolist() == [33] * n and priorities.tolist() == meta.priority[slots[:n]].tolist()
        assert generations.tolist() == meta.generation[slots[:n]].tolist()
        assert picks.first_samples == want_first and picks.deletes_last == want_delete
        per_slot = np.bincount(slots[:n], minlength=capacity)
        np.testing.assert_array_equal(meta.times_sampled, before + per_slot)
        np.testing.assert_array_equal(meta.leases, per_slot)
        book = SlotBook(capacity, 1)
        book.meta = meta
        book.unlease(picks.held)
        assert not meta.leases.any()


def test_count_picks_adds_to_leases_and_counts_already_held():
    """times_sampled and leases are written back as one pair per slot: slots already leased (by other
    selections) and sampled many times keep both counts exact, each field alone."""
    gen = np.random.default_rng(7)
    capacity = 64
    meta = ItemMetadata(capacity, 2)
    meta.times_sampled[:] = gen.integers(0, 2**31 - 100, capacity)
    meta.leases[:] = gen.integers(0, 1000, capacity)
    meta.key[:] = np.arange(capacity, dtype=np.uint64) + 7
    meta.generation[:] = 2**63 + np.arange(capacity, dtype=np.uint64)
    leases, times, generations = meta.leases.copy(), meta.times_sampled.copy(), meta.generation.copy()
    slots = gen.integers(0, capacity, 200)
    picks = count_picks(meta, slots, gen.random(200), 0, capacity, find_repeats(slots))
    per_slot = np.bincount(slots, minlength=capacity)
    np.testing.assert_array_equal(meta.times_sampled, times + per_slot)
    np.testing.assert_array_equal(meta.leases, leases + per_slot)
    np.testing.assert_array_equal(meta.generation, generations)
    assert picks.chunk[5].tolist() == one_by_one(times, slots, 0)[0]
    book = SlotBook(capacity, 2)
    book.meta = meta
    book.unlease(picks.held)
    np.testing.assert_array_equal(meta.leases, leases)
    np.testing.assert_array_equal(meta.times_sampled, times + per_slot)

def test_held_of_counts_every_pick():
    slots = np.array([5, 2, 5, 9, 5, 2], np.int64)
    book = SlotBook(16, 1)
    book.meta.leases[[2, 5, 9]] = [2, 3, 1]
    book.unlease(held_of(slots))
    assert not book.meta.leases.any()
    assert len(find_repeats(np.array([3, 1, 2]))) == 0 and len(find_repeats(np.array([4]))) == 0


def test_table_batches_with_repeats_count_lease_and_release_every_pick(store):
    """A prioritized table asked for far more picks than items: running times_sampled per item,
    unique samples counted once, every lease count given back on release."""
    table = make_table(store, sampler="prioritized", exponent=1.0, max_size=16, seed=4)
    for k in range(6):
        table.insert(item(k, priority=float(k + 1)))
    seen: dict[int, int] = {}
    for _ in range(3):
        sel = table.sample(2000)
        for key, t in zip(sel.keys.tolist(), sel.times_sampled.tolist(), strict=True):
            seen[key] = seen.get(key, 0) + 1
            assert t == seen[key]
        assert table.meta.leases.sum() == 2000
        table.release(sel.lease_id)
        assert not table.meta.leases.any()
    assert table.info().num_unique_samples == 6
    table.close()


def test_table_prioritized_max_times_sampled_cuts_batches_at_the_deleting_pick(store):
    table = make_table(store, sampler="prioritized", exponent=1.0, max_size=64, max_times_sampled=3, seed=6)
    for k in range(40):
        table.insert(item(k, priority=float(1 + k % 4)))
    sel = table.sample(60)  # picks past a deletion come from the table without that item
    counts: dict[int, int] = {}
    for key, t in zip(sel.keys.tolist(), sel.times_sampled.tolist(), strict=True):
        counts[key] = counts.get(key, 0) + 1
        assert t == counts[key] <= 3
    gone = {k for k, c in counts.items() if c == 3}
    assert gone and all(k not in table.keys() for k in gone)
    assert len(table) == 40 - len(gone)
    table.release(sel.lease_id)
    assert not table.meta.leases.any()
    table.close()


def test_uniform_selector_has_no_repeats_hint():
    sel = Uniform(8)
    sel.insert(3, 1.0, 1)
    slots, probs, repeats = sel.sample_with_repeats(4, np.random.default_rng(0))
    assert slots.tolist() == [3, 3, 3, 3] and repeats is None


def test_prioritized_running_sums_stay_exact_through_every_kind_of_change():
    """Single updates, batched ones (few blocks, most blocks), deletes, resizes and a clear: the running
    sums the picks search are the weights' own running sums, bit for bit, whenever a pick reads them."""
    gen = np.random.default_rng(11)
    sel = Prioritized(3000, priority_exponent=0.7)
    weights = np.zeros(3000)
    for slot in gen.choice(3000, 1500, replace=False).tolist():
        p = float(gen.uniform(0, 5))
        sel.insert(slot, p, slot + 1)
        weights[slot] = p ** 0.7
    for step in range(30):
        live = np.flatnonzero(weights > 0)
        few = gen.choice(live, 5, replace=False)
        many = gen.choice(live, 900, replace=False)
        slots = few if step % 3 else many
        prios = gen.uniform(0, 5, len(slots))
        sel.update_many(slots, prios, np.arange(len(slots)))
        weights[slots] = prios ** 0.7
        if step % 4 == 1:
            sel.update(int(live[0]), 2.0, 10_000 + step)
            weights[live[0]] = 2.0 ** 0.7
        if step % 5 == 2:
            sel.delete(int(live[1]))
            weights[live[1]] = 0.0
        if step == 20:
            sel.resize(9000)
            weights = np.concatenate([weights, np.zeros(6000)])
        picked, probs = sel.sample(64, np.random.default_rng(step))
        n = len(weights)
        np.testing.assert_array_equal(sel._run[:n], np.cumsum(sel._w2d, axis=1).ravel()[:n])
        np.testing.assert_array_equal(sel._bsum, sel._run2d[:, -1])
        np.testing.assert_allclose(sel._w[:n], weights, rtol=1e-12)
        assert np.all(weights[picked] > 0)
        np.testing.assert_allclose(probs, weights[picked] / weights.sum(), rtol=1e-9)
    sel.clear()
    assert sel.total_weight() == 0.0 and not sel._run.any()
