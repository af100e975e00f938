"""Table semantics (Reverb's), storage, leases, validation, growth, snapshots, concurrency."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import RateLimiterTimeout, TableClosedError
from gear_server.table.table import ItemToInsert, Table, TableSnapshot, count_leaves, leaf_paths
from tests.support.tables import LEAF, MIN_FLOAT, OBS_ACT, check_item_data, config, item, make_table, min_size


def sample_keys(table, n, **kw):
    sel = table.sample(n, **kw)
    table.release(sel.lease_id)
    return sel.keys.tolist(), sel


def state_fingerprint(table, exact=True):
    """Everything observable about a table, to check that a refused call changed nothing.

    ``exact=False`` leaves out what a restored copy legitimately differs in: per-call
    statistics (not checkpointed, as in Reverb) and the segment's file name and version.
    """
    snap = table.snapshot()
    info = table.info()
    info.ClearField("table_worker_time_ms")
    if not exact:
        info.rate_limiter_info.ClearField("insert_stats")
        info.rate_limiter_info.ClearField("sample_stats")
    layout = table.layout()
    layout = None if layout is None else layout.to_proto()
    if layout is not None and not exact:
        layout.ClearField("segment")
        layout.ClearField("version")
        layout.ClearField("segment_size")
    return (
        {k: v.tobytes() for k, v in snap.arrays.items()},
        {k: v for k, v in snap.scalars.items() if k not in ("table_worker_time_s",)},
        info.SerializeToString(),
        None if layout is None else layout.SerializeToString(),
    )


# --------------------------------------------------------------------------- basics


def test_insert_sample_read_roundtrip(store):
    table = make_table(store, max_size=10)
    for k in range(5):
        table.insert(item(k, priority=k + 1.0))
    sel = table.sample(8)
    assert len(sel) == 8
    act, obs = table.read(sel)
    assert act.shape == (8,) and obs.shape == (8 * 3, 2)
    for i, key in enumerate(sel.keys.tolist()):
        check_item_data(key, act[i], obs[3 * i:3 * i + 3])
    np.testing.assert_array_equal(sel.lengths, [[1, 3]] * 8)
    np.testing.assert_array_equal(sel.probabilities, 0.2)
    np.testing.assert_array_equal(sel.table_sizes, 5)
    np.testing.assert_array_equal(sel.priorities, sel.keys.astype(np.float64) + 1.0)
    # slot_views give the same bytes without a copy
    views = table.slot_views(sel)
    assert b"".join(bytes(v) for v in views[1]) == obs.tobytes()
    assert all(v.base is not None for v in views[1])
    table.release(sel.lease_id)
    with pytest.raises(ValueError, match="lease"):
        table.read(sel)
    table.close()


def test_variable_lengths_read_concatenated(store):
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1, max_size=10)
    for k, length in enumerate([2, 5, 1, 4]):
        table.insert(item(k, length=length))
    sel = table.sample(4)
    assert sel.keys.tolist() == [0, 1, 2, 3]
    act, obs = table.read(sel)
    assert obs.shape == (12, 2)
    t = 0
    for i, length in enumerate([2, 5, 1, 4]):
        check_item_data(i, act[i], obs[t:t + length], length)
        t += length
    table.release(sel.lease_id)
    table.close()


def test_column_given_as_chunk_pieces(store):
    table = make_table(store)
    whole = item(7, length=5)
    obs = whole.columns[1]
    table.insert(ItemToInsert(7, 1.0, OBS_ACT, [whole.columns[0], [obs[:2], obs[2:2], obs[2:]]], [True, False]))
    sel = table.sample(1)
    act, got = table.read(sel)
    check_item_data(7, act[0], got, 5)
    table.release(sel.lease_id)
    table.close()


def test_structure_helpers():
    nested = pb.Structure(kind=pb.Structure.DICT, keys=["a", "b"], children=[
        pb.Structure(kind=pb.Structure.TUPLE, children=[pb.Structure(), pb.Structure(kind=pb.Structure.NONE)]),
        pb.Structure(kind=pb.Structure.NAMEDTUPLE, keys=["x", "y"], type_name="P",
                     children=[pb.Structure(), pb.Structure()])])
    assert count_leaves(nested) == 3
    assert leaf_paths(nested) == ["a/0", "b/x", "b/y"]
    assert leaf_paths(LEAF) == ["leaf0"]


def test_config_validation(store):
    with pytest.raises(ValueError, match="name"):
        Table(config(name=""), store)
    with pytest.raises(ValueError, match="max_size"):
        Table(config(max_size=0), store)
    sig = pb.Signature(structure=OBS_ACT, leaves=[pb.TensorSpec(dtype="<i8")])
    with pytest.raises(ValueError, match="leaves"):
        Table(config(signature=sig), store)


# --------------------------------------------------------------------------- Reverb table semantics


def test_insert_when_full_removes_via_remover_and_never_exceeds_max_size(store):
    table = make_table(store, max_size=3, remover="fifo")
    for k in range(10):
        table.insert(item(k))
        assert len(table) == min(k + 1, 3)
    assert sorted(sample_keys(table, 50)[0]) and set(sample_keys(table, 50)[0]) <= {7, 8, 9}
    assert table.info().current_size == 3
    table.close()


def test_remover_can_delete_the_new_item(store):
    table = make_table(store, max_size=3, remover="min_heap")
    for k, p in enumerate([5.0, 6.0, 7.0]):
        table.insert(item(k, priority=p))
    table.insert(item(3, priority=1.0))  # lowest priority: the min-heap remover deletes it at once
    assert sorted(table.keys()) == [0, 1, 2]
    assert table.info().rate_limiter_info.num_deletes == 1
    assert table.rate_limiter_counts().inserts == 4
    table.close()


def test_existing_key_updates_priority_only(store):
    table = make_table(store, sampler="prioritized", remover="fifo")
    table.insert(item(1, priority=1.0))
    table.insert(item(2, priority=1.0))
    table.insert(item(1, priority=3.0, length=3))
    assert len(table) == 2
    keys, sel = sample_keys(table, 200)
    assert sel.priorities[sel.keys == 1][0] == 3.0
    assert sel.probabilities[sel.keys == 1][0] == pytest.approx(0.75)
    table.close()


def test_max_times_sampled_deletes_when_reached(store):
    table = make_table(store, sampler="fifo", max_times_sampled=3)
    table.insert(item(1))
    table.insert(item(2))
    sel = table.sample(4)
    assert sel.keys.tolist() == [1, 1, 1, 2]
    assert sel.times_sampled.tolist() == [1, 2, 3, 1]
    # table_size is the size before any deletion this sample causes
    assert sel.table_sizes.tolist() == [2, 2, 2, 1]
    assert table.keys() == [2]
    table.release(sel.lease_id)
    table.close()


def test_uniform_batch_with_repeats_reports_running_times_sampled(store):
    table = make_table(store, max_times_sampled=0)
    table.insert(item(1))
    sel = table.sample(5)
    assert sel.times_sampled.tolist() == [1, 2, 3, 4, 5]
    assert sel.keys.tolist() == [1] * 5
    table.release(sel.lease_id)
    sel = table.sample(2)
    assert sel.times_sampled.tolist() == [6, 7]
    table.release(sel.lease_id)
    table.close()


def test_max_times_sampled_with_uniform_batch_never_returns_deleted_items(store):
    table = make_table(store, max_times_sampled=2, max_size=100, seed=3)
    for k in range(20):
        table.insert(item(k))
    sel = table.sample(40)  # every item exactly twice, then the table is empty
    counts = {k: sel.keys.tolist().count(k) for k in range(20)}
    assert all(c == 2 for c in counts.values())
    assert len(table) == 0
    for k in range(20):
        assert [int(t) for t in sel.times_sampled[sel.keys == k]] == [1, 2]
    assert table.info().num_unique_samples == 20
    table.release(sel.lease_id)
    table.close()


def test_queue_semantics(store):
    """Table.queue: fifo/fifo, max_times_sampled 1, Queue(size) limiter = (1.0, 1, 0.0, size)."""
    queue_rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=3.0)
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1, max_size=3,
                       rate_limiter=queue_rl)
    for k in range(3):
        table.insert(item(k))
    with pytest.raises(RateLimiterTimeout):
        table.insert(item(3), timeout=0.02)
    assert sample_keys(table, 2)[0] == [0, 1]
    table.insert(item(3))
    assert sample_keys(table, 2)[0] == [2, 3]
    with pytest.raises(RateLimiterTimeout):
        table.sample(1, timeout=0.02)
    table.close()


def test_stack_semantics(store):
    stack_rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=10.0)
    table = make_table(store, sampler="lifo", remover="lifo", max_times_sampled=1, max_size=10,
                       rate_limiter=stack_rl)
    for k in range(4):
        table.insert(item(k))
    assert sample_keys(table, 3)[0] == [3, 2, 1]
    table.close()


@pytest.mark.parametrize("sampler", ["fifo", "lifo"])
def test_priority_update_does_not_move_fifo_lifo(store, sampler):
    table = make_table(store, sampler=sampler)
    for k in range(3):
        table.insert(item(k))
    table.mutate_priorities({0: 50.0, 2: 0.0, 1: 7.0})
    assert sample_keys(table, 1)[0] == [0 if sampler == "fifo" else 2]
    table.close()


def test_heap_sampler_tie_break_least_recently_updated(store):
    table = make_table(store, sampler="max_heap")
    for k in range(3):
        table.insert(item(k, priority=2.0))
    assert sample_keys(table, 1)[0] == [0]
    table.mutate_priorities({0: 2.0})  # same value, now most recent
    assert sample_keys(table, 1)[0] == [1]
    table.insert(item(1, priority=2.0))  # re-insert of an existing key = update
    assert sample_keys(table, 1)[0] == [2]
    table.close()


def test_mutate_priorities_deletes_first_then_updates_unknown_ignored(store):
    table = make_table(store, sampler="prioritized")
    for k in range(4):
        table.insert(item(k))
    table.mutate_priorities({1: 5.0, 2: 9.0, 99: 3.0}, deletes=[2, 98])
    assert sorted(table.keys()) == [0, 1, 3]
    assert table.meta.priority[table.slot_of(1)] == 5.0
    assert table.info().rate_limiter_info.num_deletes == 1
    table.mutate_priorities([(0, 2.0), (0, 4.0)])  # pairs: the last update of a key wins
    assert table.meta.priority[table.slot_of(0)] == 4.0
    table.close()


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_mutate_priorities_bad_value_changes_nothing(store, bad):
    table = make_table(store, sampler="prioritized")
    for k in range(3):
        table.insert(item(k))
    before = state_fingerprint(table)
    with pytest.raises(ValueError, match="key 2"):
        table.mutate_priorities({0: 3.0, 2: bad}, deletes=[1])
    assert state_fingerprint(table) == before
    table.close()


def test_reset_empties_zeroes_counters_and_keys_are_new(store):
    table = make_table(store, max_times_sampled=1, max_size=3)
    for k in range(4):
        table.insert(item(k, episode=k))
    table.release(table.sample(1).lease_id)
    table.reset()
    info = table.info()
    assert info.current_size == 0 and info.num_episodes == 0 and info.num_deleted_episodes == 0
    assert info.num_unique_samples == 0 and info.rate_limiter_info.num_deletes == 0
    counts = table.rate_limiter_counts()
    assert (counts.inserts, counts.samples, counts.deletes) == (0, 0, 0)
    table.insert(item(0))  # a key seen before the reset is a new item now
    assert len(table) == 1 and table.meta.times_sampled[table.slot_of(0)] == 0
    table.close()


def test_info_fields(store):
    table = make_table(store, sampler="prioritized", remover="fifo", max_size=3, max_times_sampled=50, exponent=0.5)
    table.insert(item(1, episode=10))
    table.insert(item(2, episode=10))
    table.insert(item(3, episode=11))
    table.insert(item(4, episode=12))  # evicts key 1 (episode 10 still referenced by key 2)
    info = table.info()
    assert info.name == "t" and info.max_size == 3 and info.max_times_sampled == 50
    assert info.sampler_options.prioritized.priority_exponent == 0.5 and info.remover_options.fifo
    assert info.current_size == 3
    assert info.num_episodes == 3 and info.num_deleted_episodes == 0
    table.mutate_priorities(deletes=[2])  # episode 10 fully gone
    info = table.info()
    assert info.num_episodes == 2 and info.num_deleted_episodes == 1
    table.release(table.sample(10).lease_id)
    info = table.info()
    assert info.num_unique_samples == 2
    assert info.rate_limiter_info.sample_stats.completed == 10
    assert info.rate_limiter_info.insert_stats.completed == 4
    assert info.rate_limiter_info.num_deletes == 2
    assert info.rate_limiter_info.samples_per_insert == 1.0 and info.rate_limiter_info.min_size_to_sample == 1
    assert info.table_worker_time_ms > 0
    # no configured signature: none reported (Reverb's signature=None); the learned layout stays internal
    assert not info.HasField("signature") and table.signature() is None
    layout = table.layout()
    assert layout.structure == OBS_ACT
    assert [(c.name, c.dtype.str, c.shape, c.squeeze) for c in layout.columns] == [
        ("act", "<i8", (), True), ("obs", "<f4", (2,), False)]
    table.close()


def test_info_reports_given_signature(store):
    sig = pb.Signature(structure=OBS_ACT, leaves=[pb.TensorSpec(name="a", dtype="<i8", shape=[]),
                                                  pb.TensorSpec(name="o", dtype="<f4", shape=[3, 2])])
    table = make_table(store, signature=sig)
    assert table.info().signature == sig
    table.insert(item(1))
    assert table.info().signature == sig
    assert [c.name for c in table.layout().columns] == ["a", "o"]
    assert table.layout().columns[1].max_length == 3  # fixed by the signature's time dimension
    table.close()


# --------------------------------------------------------------------------- validation


def _bad_items():
    good = item(50)
    act, obs = good.columns
    return {
        "dtype": (ItemToInsert(50, 1.0, OBS_ACT, [act, obs.astype(np.float64)], [True, False]), "column 'obs'"),
        "step shape": (ItemToInsert(50, 1.0, OBS_ACT, [act, np.zeros((3, 3), np.float32)], [True, False]),
                       "column 'obs'"),
        "squeeze flip": (ItemToInsert(50, 1.0, OBS_ACT, [act.reshape(1), obs], [False, False]), "column 'act'"),
        "leaf count": (ItemToInsert(50, 1.0, OBS_ACT, [act], [True]), "leaves"),
        "no columns": (ItemToInsert(50, 1.0, pb.Structure(kind=pb.Structure.LIST), [], []), "empty"),
        "zero length": (ItemToInsert(50, 1.0, OBS_ACT, [act, obs[:0]], [True, False]), "empty"),
        "nan priority": (ItemToInsert(50, float("nan"), OBS_ACT, [act, obs], [True, False]), "NaN"),
        "negative priority": (ItemToInsert(50, -0.5, OBS_ACT, [act, obs], [True, False]), ">= 0"),
        "inf priority": (ItemToInsert(50, float("inf"), OBS_ACT, [act, obs], [True, False]), "finite"),
        "not an array": (ItemToInsert(50, 1.0, OBS_ACT, [act, obs.tolist()], [True, False]), "numpy"),
        "squeeze flags": (ItemToInsert(50, 1.0, OBS_ACT, [act, obs], [True]), "squeeze"),
        "object dtype": (ItemToInsert(50, 1.0, OBS_ACT, [act, obs.astype(object)], [True, False]), "object"),
        "key range": (ItemToInsert(-1, 1.0, OBS_ACT, [act, obs], [True, False]), "uint64"),
    }


# The layout cases (dtype, step shape, squeeze, leaf count) are bad against a signature; a table without
# one keeps such items beside its column layout (test_learned_layout.py), and a signature
# compares flattened leaves, not the nest (test_signature_leaves.py).
ITEM_SIGNATURE = pb.Signature(structure=OBS_ACT, leaves=[pb.TensorSpec(dtype="<i8", shape=[]),
                                                         pb.TensorSpec(dtype="<f4", shape=[-1, 2])])


@pytest.mark.parametrize("case", list(_bad_items()))
def test_bad_item_rejected_and_table_unchanged(store, case):
    table = make_table(store, sampler="prioritized", max_size=4, signature=ITEM_SIGNATURE)
    for k in range(4):
        table.insert(item(k))
    sel = table.sample(2)
    table.release(sel.lease_id)
    before = state_fingerprint(table)
    bad, message = _bad_items()[case]
    with pytest.raises(ValueError, match=message):
        table.insert(bad)
    assert state_fingerprint(table) == before
    # the table keeps serving
    table.insert(item(60))
    assert 60 in table.keys()
    table.close()


def test_bad_existing_key_item_is_rejected_too(store):
    table = make_table(store, signature=ITEM_SIGNATURE)
    table.insert(item(1))
    before = state_fingerprint(table)
    good = item(1)
    with pytest.raises(ValueError, match="column 'obs'"):
        table.insert(ItemToInsert(1, 9.0, OBS_ACT, [good.columns[0], good.columns[1].astype(np.int32)],
                                  [True, False]))
    assert state_fingerprint(table) == before
    table.close()


def test_signature_checks_dtype_shape_and_length(store):
    sig = pb.Signature(structure=OBS_ACT, leaves=[pb.TensorSpec(name="act", dtype="<i8", shape=[]),
                                                  pb.TensorSpec(name="obs", dtype="<f4", shape=[-1, 2])])
    table = make_table(store, signature=sig, initial_max_length=2)
    assert table.layout() is None
    with pytest.raises(ValueError, match="column 'obs'.*dtype"):
        table.insert(ItemToInsert(1, 1.0, OBS_ACT, [np.array(1), np.zeros((3, 2), np.float64)], [True, False]))
    assert table.layout() is None and table.info().current_size == 0  # nothing learned from a refused item
    table.insert(item(1, length=3))
    table.insert(item(2, length=7))  # -1 time dim: longer items grow the slots
    assert table.layout().columns[1].max_length >= 7
    fixed = pb.Signature(structure=OBS_ACT, leaves=[pb.TensorSpec(name="act", dtype="<i8", shape=[]),
                                                    pb.TensorSpec(name="obs", dtype="<f4", shape=[4, 2])])
    t2 = make_table(store, name="fixed", signature=fixed)
    with pytest.raises(ValueError, match=r"column 'obs'.*\[5, 2\].*\[4, 2\]"):
        t2.insert(item(1, length=5))  # longer than the signature allows
    with pytest.raises(ValueError, match=r"column 'obs'.*\[3, 2\].*\[4, 2\]"):
        t2.insert(item(1, length=3))
    t2.insert(item(1, length=4))
    table.close()
    t2.close()


# --------------------------------------------------------------------------- storage: growth, leases


def test_growth_keeps_items(store):
    table = make_table(store, max_size=50, sampler="fifo", remover="fifo", max_times_sampled=1)
    lengths = [1, 2, 3, 5, 8, 13, 2, 40, 1]
    versions = []
    for k, length in enumerate(lengths):
        table.insert(item(k, length=length))
        versions.append(table.layout().version)
    assert versions[-1] > versions[0]
    assert table.layout().columns[1].max_length >= 40
    sel = table.sample(len(lengths))
    act, obs = table.read(sel)
    t = 0
    for k, length in enumerate(lengths):
        check_item_data(k, act[k], obs[t:t + length], length)
        t += length
    table.release(sel.lease_id)
    table.close()


def test_initial_max_length_sets_first_layout(store):
    table = make_table(store, initial_max_length=16)
    table.insert(item(1, length=3))
    assert table.layout().columns[1].max_length == 16 and table.layout().columns[0].max_length == 1
    table.close()


def test_leased_slot_not_reused_until_released(store):
    table = make_table(store, max_size=4, spare_slots=2, remover="fifo")
    for k in range(4):
        table.insert(item(k))
    sel = table.sample(1)
    key = int(sel.keys[0])
    slot = int(sel.slots[0])
    generation = int(table.meta.generation[slot])
    assert table.meta.leases[slot] == 1
    table.mutate_priorities(deletes=[key])  # deleted while leased
    for k in range(100, 130):  # churn through every free slot many times (spare runs out -> capacity grows)
        table.insert(item(k))
    assert int(table.meta.generation[slot]) == generation  # never rewritten
    act, obs = table.read(sel)
    check_item_data(key, act[0], obs)
    table.release(sel.lease_id)
    assert table.meta.leases[slot] == 0
    for k in range(200, 220):
        table.insert(item(k))
    assert int(table.meta.generation[slot]) > generation  # reusable after release
    table.close()


def test_capacity_grows_when_leased_slots_exhaust_the_spares(store):
    table = make_table(store, max_size=2, spare_slots=1, sampler="fifo", remover="fifo")
    table.insert(item(0))
    table.insert(item(1))
    a = table.sample(1)
    table.mutate_priorities(deletes=[0])
    b = table.sample(1)
    table.mutate_priorities(deletes=[1])
    assert a.keys.tolist() == [0] and b.keys.tolist() == [1]
    version = table.layout().version
    for k in range(10, 14):  # two slots leased, one free: the second insert needs a new slot
        table.insert(item(k))
    assert table.capacity > 3 and table.layout().version > version
    assert len(table) == 2
    for sel, key in ((a, 0), (b, 1)):
        act, obs = table.read(sel)
        check_item_data(key, act[0], obs)
    table.release(a.lease_id)
    table.release(b.lease_id)
    assert sorted(table.keys()) == [12, 13]
    table.close()


def test_slots_reused_without_growth_when_unleased(store):
    table = make_table(store, max_size=4, spare_slots=2)
    for k in range(100):
        table.insert(item(k))
    assert table.capacity == 6
    assert table.layout().version == 0
    table.close()


def test_release_is_idempotent_and_leases_counted(store):
    table = make_table(store)
    table.insert(item(1))
    a = table.sample(3)
    b = table.sample(2)
    slot = table.slot_of(1)
    assert table.meta.leases[slot] == 5
    table.release(a.lease_id)
    table.release(a.lease_id)
    table.release(12345)
    assert table.meta.leases[slot] == 2
    table.release(b.lease_id)
    assert table.meta.leases[slot] == 0 and table.active_leases() == 0
    table.close()


# --------------------------------------------------------------------------- snapshot / restore


@pytest.mark.parametrize("sampler,remover", [("uniform", "fifo"), ("prioritized", "lifo"),
                                             ("max_heap", "min_heap"), ("fifo", "uniform")])
def test_snapshot_restore_behaves_identically(store, sampler, remover):
    kw = dict(sampler=sampler, remover=remover, max_size=12, max_times_sampled=4, exponent=0.7)
    table = make_table(store, name="a", seed=11, **kw)
    rng = np.random.default_rng(0)
    for k in range(20):
        table.insert(item(k, priority=float(rng.integers(0, 5)), length=int(rng.integers(1, 6)), episode=k // 3))
    table.mutate_priorities({3: 0.0, 15: 7.0, 16: 7.0}, deletes=[10])
    table.release(table.sample(7).lease_id)
    snap = table.snapshot()
    assert isinstance(snap, TableSnapshot)
    import json
    json.dumps(snap.scalars)  # scalars are JSON-serialisable

    restored = make_table(store, name="a", seed=999, **kw)  # the snapshot's RNG state wins over the seed
    restored.restore(snap)
    assert state_fingerprint(restored, False) == state_fingerprint(table, False)

    def run(t):
        out = []
        for k in range(100, 110):
            t.insert(item(k, priority=1.0 + k % 3, length=2))
            sel = t.sample(3)
            out.append((sel.keys.tolist(), sel.times_sampled.tolist(), sel.probabilities.round(12).tolist(),
                        sel.table_sizes.tolist(), [a.tobytes() for a in t.read(sel)]))
            t.release(sel.lease_id)
        t.mutate_priorities({100: 9.0}, deletes=[101])
        out.append(sorted(t.keys()))
        return out

    assert run(restored) == run(table)
    assert restored.info().num_episodes == table.info().num_episodes
    table.close()
    restored.close()


def test_restore_refuses_nonempty_or_oversized(store):
    a = make_table(store, name="a", max_size=5)
    for k in range(5):
        a.insert(item(k))
    snap = a.snapshot()
    b = make_table(store, name="b", max_size=5)
    b.insert(item(9))
    with pytest.raises(ValueError, match="empty"):
        b.restore(snap)
    c = make_table(store, name="c", max_size=3)
    with pytest.raises(ValueError, match="max_size"):
        c.restore(snap)
    empty = make_table(store, name="d").snapshot()
    d = make_table(store, name="d")
    d.restore(empty)
    assert len(d) == 0 and d.layout() is None
    for t in (a, b, c, d):
        t.close()


# --------------------------------------------------------------------------- concurrency


def test_concurrent_inserts_and_samples_keep_data_intact(store):
    table = make_table(store, max_size=64, remover="fifo")
    errors = []
    n_writers, per_writer = 4, 150

    def writer(w):
        try:
            for i in range(per_writer):
                k = w * 10_000 + i
                table.insert(item(k, length=1 + k % 7))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def reader():
        try:
            for _ in range(150):
                sel = table.sample(8, timeout=10)
                act, obs = table.read(sel)
                t = 0
                for i, k in enumerate(sel.keys.tolist()):
                    length = int(sel.lengths[i, 1])
                    check_item_data(k, act[i], obs[t:t + length], length)
                    t += length
                table.release(sel.lease_id)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(n_writers)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert not errors, errors[:3]
    assert len(table) == 64
    assert table.rate_limiter_counts().inserts == n_writers * per_writer
    assert table.rate_limiter_counts().pending_inserts == 0
    assert int(table.meta.valid.sum()) == 64
    assert table.meta.leases.sum() == 0
    table.close()


def test_concurrent_duplicate_keys_insert_once(store):
    table = make_table(store, max_size=100)
    barrier = threading.Barrier(6)

    def go():
        barrier.wait()
        for k in range(50):
            table.insert(item(k))

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(table) == 50 and table.rate_limiter_counts().inserts == 50
    assert table.slot_counts().free == table.capacity - 50
    table.close()


def test_close_unlinks_and_refuses_calls(store):
    table = make_table(store)
    table.insert(item(1))
    path = table.layout().segment
    sel = table.sample(1)
    table.close()
    assert not os.path.exists(path)
    for call in (lambda: table.insert(item(2)), lambda: table.sample(1), lambda: table.read(sel),
                 lambda: table.mutate_priorities({1: 1.0}), table.reset):
        with pytest.raises(TableClosedError):
            call()
    table.close()  # idempotent


def test_sample_timeout_zero_and_bad_count(store):
    table = make_table(store, rate_limiter=min_size(2))
    with pytest.raises(ValueError):
        table.sample(0)
    t0 = time.monotonic()
    with pytest.raises(RateLimiterTimeout):
        table.sample(1, timeout=0)
    assert time.monotonic() - t0 < 0.5
    table.close()


# --------------------------------------------------------------------------- scale


def test_million_item_table_sanity(store):
    """A 1M-item prioritized table (built by restore): sample, insert when full, mutate 4096 keys."""
    n = 1_000_000
    kw = dict(name="big", sampler="prioritized", remover="fifo", max_size=n, exponent=1.0,
              rate_limiter=pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1,
                                                 min_diff=MIN_FLOAT, max_diff=1.7976931348623157e308))
    rng = np.random.default_rng(0)
    keys = np.arange(n, dtype=np.uint64)
    pri = rng.random(n) + 0.01
    seqs = np.arange(1, n + 1, dtype=np.int64)
    snap = TableSnapshot(arrays={
        "keys": keys, "priorities": pri, "insert_seq": seqs, "update_seq": seqs,
        "times_sampled": np.zeros(n, np.int32), "lengths": np.ones((n, 1), np.int32),
        "column/0": np.arange(n, dtype=np.int64).reshape(n, 1), "episode_counts": np.zeros(n, np.int64),
        "episode_ids": np.zeros(0, np.uint64), "structure": np.frombuffer(LEAF.SerializeToString(), np.uint8)},
        scalars={"name": "big", "num_items": n, "has_structure": True, "seq": n,
                 "columns": [{"name": "leaf0", "dtype": "<i8", "shape": [], "squeeze": False, "max_length": 1}],
                 "rate_limiter": {"inserts": n, "samples": 0, "deletes": 0}, "num_deleted_episodes": 0,
                 "num_unique_samples": 0})
    table = make_table(store, **kw)
    table.restore(snap)
    assert len(table) == n
    sel = table.sample(256)
    data = table.read(sel)[0]
    np.testing.assert_array_equal(data, sel.keys.astype(np.int64))
    np.testing.assert_allclose(sel.probabilities, pri[sel.keys.astype(np.int64)] / pri.sum(), rtol=1e-9)
    table.release(sel.lease_id)
    for k in range(n, n + 1000):  # insert when full: fifo remover evicts the oldest, O(1) each
        table.insert(ItemToInsert(k, 1.0, LEAF, [np.array([k], np.int64)], [False]))
    assert len(table) == n and 999 not in table.keys() and 1000 in table.keys()
    upd = {int(k): 2.0 for k in rng.choice(n, 4096, replace=False) if k >= 1000}
    table.mutate_priorities(upd)
    slot = table.slot_of(next(iter(upd)))
    assert table.meta.priority[slot] == 2.0
    table.close()


def test_table_prioritized_distribution_matches_reported_probabilities(store):
    """Through Table.sample (batched picks, leases): frequencies follow w/sum(w), chi-square at p = 0.001."""
    from tests.support.statistics import chi2_critical, chi2_statistic

    table = make_table(store, sampler="prioritized", exponent=0.5, max_size=16, seed=5)
    priorities = [1.0, 4.0, 9.0, 16.0, 0.0, 25.0]
    for k, p in enumerate(priorities):
        table.insert(item(k, priority=p))
    w = np.sqrt(priorities)
    expect = w / w.sum()
    counts = np.zeros(len(priorities))
    for _ in range(100):
        sel = table.sample(300)
        np.testing.assert_allclose(sel.probabilities, expect[sel.keys.astype(np.int64)], rtol=1e-12)
        counts += np.bincount(sel.keys.astype(np.int64), minlength=len(priorities))
        table.release(sel.lease_id)
    assert counts[4] == 0
    nz = expect > 0
    assert chi2_statistic(counts[nz], expect[nz]) < chi2_critical(int(nz.sum()) - 1)
    table.close()
