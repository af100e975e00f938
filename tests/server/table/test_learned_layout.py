"""Signature-less tables: no reported signature, a layout learned from the first item and
relearned once the table is empty; reset's rate-limiter counters (Reverb 0.14)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.table import ItemToInsert
from tests.support.tables import LEAF, OBS_ACT, check_item_data, item, make_table

PAIR = pb.Structure(kind=pb.Structure.TUPLE, children=[pb.Structure(), pb.Structure()])


def leaf_item(key: int, data: np.ndarray, priority: float = 1.0) -> ItemToInsert:
    """A single-leaf item whose column is ``data`` ([T, *shape])."""
    return ItemToInsert(key=key, priority=priority, structure=LEAF, columns=[data], squeeze=[False])


def read_one(table, n: int = 1):
    sel = table.sample(n)
    try:
        return sel, table.read(sel)
    finally:
        table.release(sel.lease_id)


# --------------------------------------------------------------------------- no reported signature


def test_signature_less_table_reports_no_signature_before_and_after_items(store):
    table = make_table(store)
    assert not table.info().HasField("signature") and table.signature() is None
    table.insert(item(1))
    info = table.info()
    assert not info.HasField("signature") and table.signature() is None
    assert table.layout() is not None and table.layout().structure == OBS_ACT  # learned, internal
    table.close()


def test_configured_signature_is_reported_and_never_relearned(store):
    sig = pb.Signature(structure=OBS_ACT, leaves=[pb.TensorSpec(name="act", dtype="<i8", shape=[]),
                                                  pb.TensorSpec(name="obs", dtype="<f4", shape=[-1, 2])])
    table = make_table(store, signature=sig)
    table.insert(item(1))
    table.reset()
    version = table.layout().version
    with pytest.raises(ValueError, match=r"column 'obs'.*dtype"):
        table.insert(ItemToInsert(2, 1.0, OBS_ACT, [np.array(2), np.zeros((3, 2), np.float64)], [True, False]))
    assert table.info().signature == sig and table.layout().version == version and len(table) == 0
    table.close()


# --------------------------------------------------------------------------- relearning when empty


def test_reset_then_a_different_item_relearns_the_layout(store):
    table = make_table(store, sampler="fifo", remover="fifo")
    for k in range(3):
        table.insert(item(k))
    old = table.layout()
    table.reset()
    assert table.layout() == old  # nothing changes until an item needs another layout
    data = np.arange(12, dtype=np.int16).reshape(4, 3)
    table.insert(leaf_item(7, data))
    new = table.layout()
    assert new.version == old.version + 1
    assert not os.path.exists(old.segment) and os.path.exists(new.segment)  # the old segment is released
    assert new.structure == LEAF
    assert [(c.dtype, c.shape, c.squeeze) for c in new.columns] == [(np.dtype(np.int16), (3,), False)]
    sel, (col,) = read_one(table)
    assert sel.layout_version == new.version and sel.keys.tolist() == [7]
    np.testing.assert_array_equal(col, data)
    assert not table.info().HasField("signature")
    # the new layout holds while items are in: a later item of the old kind is kept beside it
    table.insert(item(8))
    assert table.layout() == new and len(table) == 2
    table.close()


def test_same_layout_after_reset_keeps_the_segment(store):
    table = make_table(store)
    table.insert(item(1))
    before = table.layout()
    table.reset()
    table.insert(item(2, length=2))
    assert table.layout() == before  # no churn when the next item fits
    table.close()


@pytest.mark.parametrize("how", ["deletes", "max_times_sampled"])
def test_table_emptied_by_removals_relearns(store, how):
    table = make_table(store, sampler="fifo", remover="fifo", max_size=2,
                       max_times_sampled=1 if how == "max_times_sampled" else 0)
    table.insert(item(1))
    table.insert(item(2))
    if how == "deletes":
        table.mutate_priorities(deletes=[1, 2])
    else:
        table.release(table.sample(2).lease_id)
    assert len(table) == 0
    version = table.layout().version
    table.insert(leaf_item(3, np.ones((2, 5), np.float64)))
    assert table.layout().version == version + 1
    _, (col,) = read_one(table)
    np.testing.assert_array_equal(col, np.ones((2, 5)))
    table.close()


@pytest.mark.parametrize("change", ["dtype", "step shape", "squeeze", "structure"])
def test_item_breaking_the_layout_is_kept_beside_it_while_items_are_held(store, change):
    """Reverb's tables without a signature take items of any structure: the column layout
    stays, the other item is kept aside and sampled back as it was."""
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1)
    table.insert(item(1))
    version = table.layout().version
    act, obs = item(2).columns
    bad = {
        "dtype": (ItemToInsert(2, 1.0, OBS_ACT, [act, obs.astype(np.float16)], [True, False]), "column 'obs'.*dtype"),
        "step shape": (ItemToInsert(2, 1.0, OBS_ACT, [act, np.zeros((3, 4), np.float32)], [True, False]),
                       "column 'obs'.*step shape"),
        "squeeze": (ItemToInsert(2, 1.0, OBS_ACT, [act.reshape(1), obs], [False, False]), "column 'act'.*squeezed"),
        "structure": (ItemToInsert(2, 1.0, pb.Structure(kind=pb.Structure.DICT, keys=["act", "obs", "rew"],
                                                        children=[pb.Structure()] * 3),
                                   [act, obs, np.zeros(3, np.float32)], [True, False, False]),
                      "column 'rew' .*not in the table's structure"),
    }[change]
    table.insert(bad[0])
    assert table.layout().version == version and sorted(table.keys()) == [1, 2]
    sel = table.sample(2)
    groups = {int(sel.keys[g.start]): g for g in table.item_groups(sel)}
    a, o = groups[1].parts
    check_item_data(1, a[0], o[0])
    other = groups[2]
    assert [np.asarray(p[0]).tobytes() for p in other.parts] == [np.asarray(c).tobytes() for c in bad[0].columns]
    assert [(dt, sh) for dt, sh, _ in other.columns] == [
        (c.dtype, c.shape if sq else c.shape[1:]) for c, sq in zip(bad[0].columns, bad[0].squeeze, strict=True)]
    assert bad[1]  # an item of another layout is held, not refused
    table.release(sel.lease_id)
    table.close()


def test_outstanding_lease_blocks_relearning_until_released(store):
    table = make_table(store, sampler="fifo", remover="fifo")
    table.insert(item(1))
    sel = table.sample(1)  # a reader holds slot bytes of the old layout
    table.reset()
    other = leaf_item(2, np.zeros((2, 2), np.uint8))
    version = table.layout().version
    table.insert(other)  # no relearning under a lease: the item is kept beside the layout
    assert table.layout().version == version and len(table) == 1
    act, obs = table.read(sel)  # the leased bytes are intact
    check_item_data(1, act[0], obs)
    table.release(sel.lease_id)
    table.reset()
    table.insert(other)  # empty and unleased: now the layout is relearned
    assert table.layout().version == version + 1 and len(table) == 1
    table.close()


def test_learned_layout_survives_snapshot_and_restore_after_relearning(store):
    table = make_table(store, name="a", sampler="fifo", remover="fifo")
    table.insert(item(1))
    table.reset()
    table.insert(ItemToInsert(5, 2.0, PAIR, [np.full((2, 3), 5, np.int32), np.array(0.5, np.float32)],
                              [False, True]))
    copy = make_table(store, name="a_copy", sampler="fifo", remover="fifo")
    copy.restore(table.snapshot())
    assert copy.layout().structure == PAIR and not copy.info().HasField("signature")
    _, (ints, half) = read_one(copy)
    np.testing.assert_array_equal(ints, np.full((2, 3), 5, np.int32))
    assert half.tolist() == [0.5]
    table.close()
    copy.close()


def test_concurrent_inserts_of_two_kinds_with_resets_keep_one_layout(store):
    """Writers of two item kinds race resets: every insert lands whole or is refused naming what differs."""
    table = make_table(store, max_size=32, remover="fifo")
    kinds = {
        0: lambda k: item(k, length=1 + k % 4),
        1: lambda k: leaf_item(k, np.full((1 + k % 3, 5), k, np.int64)),
    }
    stop = threading.Event()
    unexpected: list[BaseException] = []
    counts = {"ok": 0, "refused": 0}
    lock = threading.Lock()

    def writer(kind: int) -> None:
        k = kind * 1_000_000
        while not stop.is_set():
            k += 1
            try:
                table.insert(kinds[kind](k), timeout=5)
                outcome = "ok"
            except BaseException as e:  # noqa: BLE001
                unexpected.append(e)
                return
            with lock:
                counts[outcome] += 1

    threads = [threading.Thread(target=writer, args=(w % 2,)) for w in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(150):
            time.sleep(0.002)  # let the writers run
            table.reset()
            if len(table):
                sel = table.sample(4, timeout=5)
                for group in table.item_groups(sel):  # each item's bytes are its own, whatever its layout
                    for i, key in enumerate(sel.keys[group.start:group.stop].tolist()):
                        if len(group.parts) == 2:
                            ln = int(group.lengths[i, 1])
                            check_item_data(key, group.parts[0][i], group.parts[1][i], ln)
                        else:
                            assert (group.parts[0][i] == key).all()
                table.release(sel.lease_id)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not unexpected, unexpected[:3]
    assert counts["ok"] > 0 and counts["refused"] == 0
    layout = table.layout()
    assert layout.structure in (OBS_ACT, LEAF)
    # the only segment left is the current one
    assert store.paths() == [layout.segment]
    table.close()


# --------------------------------------------------------------------------- reset and the call stats


def test_reset_zeroes_reported_completed_counts_as_reverb(store):
    """Reverb 0.14 reports the rate limiter's insert/sample counters as insert_stats/sample_stats.completed."""
    table = make_table(store)
    for k in range(4):
        table.insert(item(k))
    table.insert(item(0, priority=3.0))  # a priority update is not an insert
    table.release(table.sample(6).lease_id)
    rl = table.info().rate_limiter_info
    assert (rl.insert_stats.completed, rl.sample_stats.completed) == (4, 6)
    table.reset()
    rl = table.info().rate_limiter_info
    assert (rl.insert_stats.completed, rl.sample_stats.completed, rl.num_deletes) == (0, 0, 0)
    table.insert(item(9))
    table.release(table.sample(1).lease_id)
    rl = table.info().rate_limiter_info
    assert (rl.insert_stats.completed, rl.sample_stats.completed) == (1, 1)
    table.close()


def test_reset_keeps_cumulative_wait_stats(store):
    """``limited`` and wait times (gear's additions, fed to metrics) are cumulative: reset leaves them."""
    table = make_table(store)
    with pytest.raises(Exception, match="Timeout"):
        table.sample(1, timeout=0.05)
    before = table.info().rate_limiter_info.sample_stats
    assert before.limited == 1 and before.completed_wait_time_s > 0.04 and before.completed == 0
    table.reset()
    after = table.info().rate_limiter_info.sample_stats
    assert after.limited == 1 and after.completed_wait_time_s == before.completed_wait_time_s
    table.close()


def test_restored_table_reports_restored_counters(store):
    table = make_table(store, name="c")
    for k in range(3):
        table.insert(item(k))
    table.release(table.sample(2).lease_id)
    copy = make_table(store, name="c_copy")
    copy.restore(table.snapshot())
    rl = copy.info().rate_limiter_info
    assert (rl.insert_stats.completed, rl.sample_stats.completed) == (3, 2)
    table.close()
    copy.close()


# --------------------------------------------------------------------------- end to end (gRPC, client)


@pytest.mark.parametrize("planes", [None, ()], ids=["shm-plane", "inline"])
def test_client_sees_no_signature_and_a_relearned_table_serves_new_items(planes):
    """Through gRPC: signature None; a learner's data-plane session notices the relearned layout."""
    import gear_client as reverb

    srv = reverb.Server([reverb.Table("free", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10,
                                      reverb.rate_limiters.MinSize(1))])
    try:
        client = reverb.Client(f"localhost:{srv.port}", data_planes=planes)
        assert client.server_info(timeout=10)["free"].signature is None
        client.insert({"obs": np.full(3, 2.5, np.float32)}, {"free": 1.0})
        assert client.server_info(timeout=10)["free"].signature is None
        first = next(iter(client.sample("free", 1, emit_timesteps=False)))  # the session learns layout v0
        np.testing.assert_array_equal(np.asarray(first.data[0]), np.full((1, 3), 2.5, np.float32))
        client.insert({"obs": np.zeros(4, np.float32)}, {"free": 1.0})  # another shape: kept as it is (12.3)
        assert client.server_info(timeout=10)["free"].current_size == 2
        client.reset("free")
        assert client.server_info(timeout=10)["free"].rate_limiter_info.insert_stats.completed == 0
        client.insert({"obs": np.arange(4, dtype=np.int8)}, {"free": 1.0})
        sample = next(iter(client.sample("free", 1, emit_timesteps=False, unpack_as_table_signature=True)))
        assert isinstance(sample.data, list)  # no signature: flat data, as Reverb
        got = np.asarray(sample.data[0])
        assert got.dtype == np.int8
        np.testing.assert_array_equal(got, np.arange(4, dtype=np.int8)[None])
        # a trajectory writer has no signature to validate against: the item goes in
        with client.trajectory_writer(2) as writer:
            writer.append({"obs": np.arange(4, dtype=np.int8)})
            writer.create_item("free", 1.0, {"obs": writer.history["obs"][-1:]})
        assert client.server_info(timeout=10)["free"].current_size == 2
    finally:
        srv.stop()


# --------------------------------------------------------------------------- segment creation fails


def test_failed_segment_creation_leaves_the_table_as_it_was(store, monkeypatch):
    """A segment that cannot be made (full tmpfs) refuses that insert; the table keeps its layout and serves."""
    table = make_table(store, sampler="fifo", remover="fifo", max_size=4, spare_slots=1)
    real_create = store.create

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "create", full)
    with pytest.raises(OSError):  # the first item cannot fix a layout
        table.insert(item(1))
    assert table.layout() is None and len(table) == 0
    monkeypatch.setattr(store, "create", real_create)
    table.insert(item(1))
    table.reset()
    layout = table.layout()
    monkeypatch.setattr(store, "create", full)
    with pytest.raises(OSError):  # relearning a different layout fails
        table.insert(leaf_item(2, np.zeros((2, 3), np.int16)))
    with pytest.raises(OSError):  # growing longer slots fails
        table.insert(item(3, length=50))
    assert table.layout() == layout and len(table) == 0
    table.insert(item(4))  # the old layout still takes items
    sel, (act, obs) = read_one(table)
    check_item_data(4, act[0], obs)
    monkeypatch.setattr(store, "create", real_create)
    table.insert(leaf_item(5, np.zeros((2, 3), np.int16)))  # it holds an item of the old layout: kept aside
    assert table.layout() == layout and len(table) == 2
    table.close()
