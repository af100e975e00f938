"""Tables without a signature hold items of any structure, as Reverb's.

The first item's layout keeps the fast column slots; items of another structure,
dtype or step shape are kept beside it (gear_server/table/side_store.py) and come back
with their own dtypes and shapes. Selection, leases, the rate limiter and Reverb's
semantics do not change; such items travel inline only.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import NeedsInlinePlane
from gear_server.table.table import ItemToInsert
from tests.support.tables import LEAF, make_table

KINDS = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([5, 6], np.int64), np.array([True, False, True])]


def leaf(key: int, data: np.ndarray) -> ItemToInsert:
    """A single-leaf item of one step ``data`` (as Reverb's client.insert makes)."""
    return ItemToInsert(key=key, priority=1.0, structure=LEAF, columns=[data[None]], squeeze=[False])


def test_the_issues_queue_takes_three_kinds_and_returns_each_as_it_was():
    import gear_client as reverb

    server = reverb.Server([reverb.Table.queue("q", 10)])
    try:
        client = reverb.Client(f"localhost:{server.port}")  # default planes: shm on this host
        for data in KINDS:
            client.insert(data, {"q": 1.0})
        got = [np.asarray(s[0].data[0]) for s in client.sample("q", 3)]
        for data, out in zip(KINDS, got, strict=True):
            assert out.dtype == data.dtype and out.shape == data.shape
            np.testing.assert_array_equal(out, data)
        assert client.server_info(timeout=10)["q"].current_size == 0  # the queue gave each exactly once
    finally:
        server.stop()


def test_a_learner_on_shm_follows_a_table_that_starts_holding_other_kinds():
    import gear_client as reverb

    server = reverb.Server([reverb.Table.queue("q", 10)])
    try:
        client = reverb.Client(f"localhost:{server.port}")
        client.insert(KINDS[0], {"q": 1.0})
        first = next(iter(client.sample("q", 1)))  # opens the shm plane: one layout so far
        np.testing.assert_array_equal(np.asarray(first[0].data[0]), KINDS[0])
        for k in range(3):
            client.insert(KINDS[k], {"q": 1.0})
        got = [np.asarray(s[0].data[0]) for s in client.sample("q", 3)]
        assert [g.dtype for g in got] == [d.dtype for d in KINDS]
        for data, out in zip(KINDS, got, strict=True):
            np.testing.assert_array_equal(out, data)
        assert client.server_info(timeout=10)["q"].current_size == 0
    finally:
        server.stop()


def test_a_dataset_of_single_items_gets_each_kind_and_a_mixed_batch_is_a_clear_error():
    import gear_client as reverb
    from gear_client.datasets import TrajectoryDataset

    server = reverb.Server([reverb.Table(name, reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10,
                                         reverb.rate_limiters.MinSize(1), max_times_sampled=times)
                            for name, times in (("t", 0), ("mixed", 1))])
    try:
        client = reverb.Client(f"localhost:{server.port}")
        for data in KINDS:
            client.insert(data, {"t": 1.0, "mixed": 1.0})
        with TrajectoryDataset(f"localhost:{server.port}", "t", batch_size=1) as dataset:
            sample = next(iter(dataset))
            assert dataset.plane == "inline"  # items of several layouts: read inline
            out = np.asarray(sample.data[0])
            assert out.dtype == np.float32 and out.shape[-2:] == (3, 4)
        # a Fifo sampler over items that stay: every batch of 3 picks the oldest, the float one three times
        with TrajectoryDataset(f"localhost:{server.port}", "t", batch_size=3) as dataset:
            assert np.asarray(next(iter(dataset)).data[0]).dtype == np.float32
        # each pick takes the oldest item away: one batch of 3 holds the three kinds
        with TrajectoryDataset(f"localhost:{server.port}", "mixed", batch_size=3) as dataset, \
                pytest.raises(ValueError, match="different structures, dtypes or step shapes"):
            next(iter(dataset))
    finally:
        server.stop()


def test_selection_leases_and_deletion_are_the_tables_whatever_the_layout(store):
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1, max_size=3)
    for k, data in enumerate(KINDS):
        table.insert(leaf(k, data))
    assert table.holds_other_layouts() and len(table) == 3
    sel = table.sample(3)  # each pick deletes its item (max_times_sampled=1); the leases keep them readable
    assert sel.keys.tolist() == [0, 1, 2] and len(table) == 0
    groups = table.item_groups(sel)
    assert [(g.start, g.stop) for g in groups] == [(0, 1), (1, 2), (2, 3)]
    for g, data in zip(groups, KINDS, strict=True):
        assert g.columns == [(data.dtype, data.shape, False)]
        np.testing.assert_array_equal(g.parts[0][0], data[None])
    with pytest.raises(ValueError, match="item_groups"):
        table.read(sel)
    table.release(sel.lease_id)
    assert not table.holds_other_layouts()
    # full table: insert-then-remove, whatever the kinds (Reverb's max_size)
    for k in range(10, 16):
        table.insert(leaf(k, KINDS[k % 3]))
    assert sorted(table.keys()) == [13, 14, 15]
    table.close()


def test_readers_by_reference_are_sent_inline_before_anything_is_taken(store):
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1)
    table.insert(leaf(1, KINDS[0]))
    sel = table.sample(1, by_reference=True)  # one layout: by reference is fine
    table.release(sel.lease_id)
    table.insert(leaf(2, KINDS[0]))
    table.insert(leaf(3, KINDS[1]))
    before = table.info().rate_limiter_info.sample_stats.completed
    with pytest.raises(NeedsInlinePlane, match="inline"):
        table.sample(1, by_reference=True)
    assert len(table) == 2 and table.info().rate_limiter_info.sample_stats.completed == before
    sel = table.sample(2)  # inline readers get both
    assert sel.keys.tolist() == [2, 3]
    table.release(sel.lease_id)
    table.close()


def test_reset_and_relearning_with_other_kinds(store):
    table = make_table(store, sampler="fifo", remover="fifo")
    table.insert(leaf(1, KINDS[0]))
    table.insert(leaf(2, KINDS[1]))
    version = table.layout().version
    table.reset()
    assert not table.holds_other_layouts()
    table.insert(leaf(3, KINDS[1]))  # empty: the int64 kind now gets the column slots
    assert table.layout().version == version + 1 and not table.holds_other_layouts()
    assert table.layout().columns[0].dtype == np.int64
    table.close()


def test_snapshot_and_restore_keep_every_kind(store):
    table = make_table(store, name="a", sampler="fifo", remover="fifo", max_times_sampled=1)
    for k, data in enumerate(KINDS * 2):
        table.insert(leaf(k, data))
    snap = table.snapshot()
    assert snap.arrays["side"].tolist() == [False, True, True] * 2
    restored = make_table(store, name="b", sampler="fifo", remover="fifo", max_times_sampled=1)
    restored.restore(snap)
    sel = restored.sample(6)
    assert sel.keys.tolist() == list(range(6))
    for g in restored.item_groups(sel):
        for i in range(g.start, g.stop):
            np.testing.assert_array_equal(g.parts[0][i - g.start], KINDS[i % 3][None])
    restored.release(sel.lease_id)
    table.close()
    restored.close()


def test_open_data_plane_answers_inline_for_a_table_of_several_kinds():
    from gear_server.daemon import Daemon
    from tests.support.tables import config

    daemon = Daemon(pb.ServerConfig(bind_address="127.0.0.1", port=0, instance_name="kinds",
                                    tables=[config("t", sampler="fifo", remover="fifo")]))
    daemon.start()
    try:
        table = daemon.tables["t"]
        table.insert(leaf(1, KINDS[0]))
        table.insert(leaf(2, KINDS[2]))
        from gear_contract._proto import replay_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = pb_grpc.ReplayServiceStub(channel)
            host = daemon.host_id
            shm_only = pb.DataPlaneOffer(host_id=host, shm=True)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="t", offer=shm_only), timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "inline" in info.value.details()
            both = pb.DataPlaneOffer(host_id=host, shm=True, inline=True)
            response = stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="t", offer=both), timeout=10)
            assert response.kind == negotiation.INLINE and not response.HasField("layout")
    finally:
        daemon.stop()
