"""Server and Table: argument validation, queue/stack, TableInfo, live table views, replace."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from tests.support.compat import (
    PROMPT_S,
    gear_only,
    info_of,
    insert_request,
    raw_stub,
    reverb,
    sample_one,
    sampled_keys,
)


def _table(name: str = "t", max_size: int = 10, **kwargs):
    return reverb.Table(name, reverb.selectors.Uniform(), reverb.selectors.Fifo(), max_size,
                        reverb.rate_limiters.MinSize(1), **kwargs)


def test_server_needs_at_least_one_table():
    with pytest.raises(ValueError):
        reverb.Server(tables=[])
    with pytest.raises(ValueError):
        reverb.Server()


def test_server_rejects_tables_sharing_a_name():
    with pytest.raises(ValueError, match="dup"):
        reverb.Server(tables=[_table("dup"), _table("dup"), _table("other")])


@pytest.mark.parametrize("name", [""])
def test_table_rejects_empty_name(name):
    with pytest.raises(ValueError):
        _table(name)


@pytest.mark.parametrize("max_size", [0, -1])
def test_table_rejects_non_positive_max_size(max_size):
    with pytest.raises(ValueError):
        _table(max_size=max_size)


def test_port_none_picks_a_free_port_and_explicit_port_is_used():
    srv = reverb.Server([_table()], port=None)
    try:
        assert isinstance(srv.port, int) and srv.port > 0
        client = srv.localhost_client()
        assert set(client.server_info(timeout=PROMPT_S)) == {"t"}
    finally:
        srv.stop()

    with socket.socket() as s:
        s.bind(("localhost", 0))
        free = s.getsockname()[1]
    srv = reverb.Server([_table()], port=free)
    try:
        assert srv.port == free
        assert set(reverb.Client(f"localhost:{free}").server_info(timeout=PROMPT_S)) == {"t"}
    finally:
        srv.stop()


def test_wait_returns_once_another_thread_stops_the_server():
    srv = reverb.Server([_table()])
    waiter = threading.Thread(target=srv.wait, daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "wait() returned while the server was running"
    srv.stop()
    waiter.join(PROMPT_S)
    assert not waiter.is_alive()


def test_queue_table_options_and_order(client, table_by_name):
    info = table_by_name["queue"].info
    assert info.sampler_options.fifo and info.remover_options.fifo
    assert info.max_size == 10 and info.max_times_sampled == 1
    rl = info.rate_limiter_info
    assert (rl.samples_per_insert, rl.min_size_to_sample, rl.min_diff, rl.max_diff) == (1.0, 1, 0.0, 10.0)

    for i in range(3):
        client.insert(np.int64(i), {"queue": 1.0})
    got = [int(s.data[0][0]) for s in client.sample("queue", 3, emit_timesteps=False)]
    assert got == [0, 1, 2]
    assert info_of(client, "queue").current_size == 0  # each item is sampled once


def test_stack_table_options_and_order(client, table_by_name):
    info = table_by_name["stack"].info
    assert info.sampler_options.lifo and info.remover_options.lifo
    assert info.max_size == 10 and info.max_times_sampled == 1
    rl = info.rate_limiter_info
    assert (rl.samples_per_insert, rl.min_size_to_sample, rl.min_diff, rl.max_diff) == (1.0, 1, 0.0, 10.0)

    for i in range(3):
        client.insert(np.int64(i), {"stack": 1.0})
    got = [int(s.data[0][0]) for s in client.sample("stack", 3, emit_timesteps=False)]
    assert got == [2, 1, 0]


def test_queue_blocks_inserts_when_full(client):
    with client.trajectory_writer(1) as writer:
        writer.append({"x": np.int64(0)})
        writer.create_item("tiny_queue", 1.0, {"x": writer.history["x"][-1]})
        writer.flush(timeout_ms=int(PROMPT_S * 1000))
        writer.append({"x": np.int64(1)})
        writer.create_item("tiny_queue", 1.0, {"x": writer.history["x"][-1]})
        with pytest.raises(reverb.DeadlineExceededError):
            writer.flush(timeout_ms=300)
        assert info_of(client, "tiny_queue").current_size == 1
        assert int(sample_one(client, "tiny_queue").data[0]) == 0  # frees the queue
        writer.flush(timeout_ms=int(PROMPT_S * 1000))
    assert int(sample_one(client, "tiny_queue").data[0]) == 1


def test_table_info_has_every_reverb_field(client, table_by_name):
    assert table_by_name["prioritized"].info.signature is None  # no signature configured
    client.insert(np.float32(1.5), {"prioritized": 2.0})
    info = table_by_name["prioritized"].info
    assert info.name == "prioritized"
    assert info.sampler_options.prioritized.priority_exponent == 1.0
    assert info.remover_options.fifo
    assert info.max_size == 1000 and isinstance(info.max_size, int)
    assert info.max_times_sampled == 0
    assert info.rate_limiter_info.insert_stats.completed == 1
    assert info.rate_limiter_info.sample_stats.completed == 0
    assert info.rate_limiter_info.min_size_to_sample == 1
    assert info.current_size == 1
    assert info.num_episodes == 1
    assert info.num_deleted_episodes == 0
    assert info.num_unique_samples == 0
    assert hasattr(info, "table_worker_time")

    sample_one(client, "prioritized")
    sample_one(client, "prioritized")
    info = table_by_name["prioritized"].info
    assert info.rate_limiter_info.sample_stats.completed == 2
    assert info.num_unique_samples == 1


def test_server_info_reports_every_table(server, tables, client):
    infos = client.server_info(timeout=PROMPT_S)
    assert set(infos) == {t.name for t in tables}
    for name, info in infos.items():
        assert info.name == name
    assert infos["max_heap"].sampler_options.heap.min_heap is False
    assert infos["min_heap"].sampler_options.heap.min_heap is True
    assert infos["uniform"].sampler_options.uniform
    assert infos["sampled_twice"].max_times_sampled == 2


def test_table_object_is_a_live_view_of_the_served_table(client, table_by_name):
    table = table_by_name["min_size_2"]
    assert table.info.current_size == 0
    assert not table.can_sample(1)
    assert table.can_insert(1)
    client.insert(np.zeros(2, np.float32), {"min_size_2": 1.0})
    assert table.info.current_size == 1
    assert not table.can_sample(1)
    client.insert(np.zeros(2, np.float32), {"min_size_2": 1.0})
    assert table.info.current_size == 2
    assert table.can_sample(1)


def test_table_info_before_serving_shows_the_configuration():
    table = reverb.Table("cfg", reverb.selectors.Prioritized(0.6), reverb.selectors.Lifo(), 7,
                         reverb.rate_limiters.MinSize(3), max_times_sampled=4)
    info = table.info
    assert info.name == "cfg" and table.name == "cfg"
    assert info.max_size == 7 and info.max_times_sampled == 4 and info.current_size == 0
    assert info.sampler_options.prioritized.priority_exponent == pytest.approx(0.6)
    assert info.remover_options.lifo
    assert info.rate_limiter_info.min_size_to_sample == 3
    assert not table.can_sample(1)
    assert table.can_insert(1)


def test_replace_copies_unspecified_settings_into_a_new_empty_table(client, table_by_name):
    source = table_by_name["sampled_twice"]
    client.insert(np.zeros(1), {"sampled_twice": 1.0})
    assert source.info.current_size == 1

    copy = source.replace(name="copy", max_size=5)
    info = copy.info
    assert info.name == "copy" and info.max_size == 5
    assert info.max_times_sampled == 2
    assert info.sampler_options.fifo and info.remover_options.fifo
    assert info.rate_limiter_info.min_size_to_sample == 1
    assert info.current_size == 0

    renamed = source.replace(name="renamed", sampler=reverb.selectors.Lifo(), max_times_sampled=0)
    assert renamed.info.sampler_options.lifo and renamed.info.max_times_sampled == 0
    assert renamed.info.max_size == 1000

    srv = reverb.Server([copy, renamed])
    try:
        c = srv.localhost_client()
        c.insert(np.zeros(1), {"copy": 1.0})
        assert c.server_info(timeout=PROMPT_S)["copy"].current_size == 1
    finally:
        srv.stop()


def test_insert_into_a_full_table_evicts_with_the_remover(client):
    for i in range(3):
        client.insert(np.int64(i), {"full_fifo": 1.0})
    keys = set(sampled_keys(client, "full_fifo", 1))
    client.insert(np.int64(3), {"full_fifo": 1.0})
    info = info_of(client, "full_fifo")
    assert info.current_size == 3
    # Fifo remover: item 0 went, the sampler (Fifo) now sees item 1 first.
    assert int(sample_one(client, "full_fifo").data[0][0]) == 1
    assert keys.isdisjoint(sampled_keys(client, "full_fifo", 1))
    for i in range(4, 10):
        client.insert(np.int64(i), {"full_fifo": 1.0})
    assert info_of(client, "full_fifo").current_size == 3  # never more than max_size
    assert int(sample_one(client, "full_fifo").data[0][0]) == 7


def test_full_table_may_evict_the_item_just_inserted(client):
    for i, p in enumerate([5.0, 6.0, 7.0]):
        client.insert(np.int64(i), {"full_min_heap": p})
    client.insert(np.int64(3), {"full_min_heap": 1.0})  # lowest priority: the MinHeap remover takes it
    info = info_of(client, "full_min_heap")
    assert info.current_size == 3
    assert info.rate_limiter_info.insert_stats.completed == 4
    values = {int(s.data[0][0]) for s in client.sample("full_min_heap", 1, emit_timesteps=False)}
    assert values == {0}  # Fifo sampler: the oldest survivor
    client.insert(np.int64(4), {"full_min_heap": 9.0})  # evicts item 0 (priority 5)
    assert int(sample_one(client, "full_min_heap").data[0][0]) == 1


def test_max_times_sampled_deletes_at_that_count(client):
    client.insert(np.int64(7), {"sampled_twice": 1.0})
    first = sample_one(client, "sampled_twice")
    assert first.info.times_sampled == 1 and info_of(client, "sampled_twice").current_size == 1
    second = sample_one(client, "sampled_twice")
    assert second.info.key == first.info.key and second.info.times_sampled == 2
    assert info_of(client, "sampled_twice").current_size == 0


@gear_only
def test_inserting_an_existing_key_updates_its_priority(server, client):
    """Keys are chosen by writers; a second item with the same key is a priority update."""
    stub = raw_stub(server)
    for priority in (1.0, 7.0):
        request = insert_request("max_heap", key=4242, priority=priority, data=np.arange(2, dtype=np.float32))
        acks = list(stub.InsertStream(iter([request]), timeout=PROMPT_S))
        assert [k for a in acks for k in a.keys] == [4242]
    info = info_of(client, "max_heap")
    assert info.current_size == 1
    got = sample_one(client, "max_heap")
    assert got.info.key == 4242 and got.info.priority == 7.0
    np.testing.assert_array_equal(got.data[0], [[0.0, 1.0]])


@gear_only
def test_checkpoint_restores_tables_items_priorities_and_counters(tmp_path):
    checkpointer = reverb.checkpointers.DefaultCheckpointer(path=str(tmp_path))
    table = reverb.Table("ckpt", reverb.selectors.MaxHeap(), reverb.selectors.Fifo(), 10,
                         reverb.rate_limiters.MinSize(1))
    srv = reverb.Server([table], checkpointer=checkpointer)
    try:
        c = srv.localhost_client()
        c.insert(np.arange(3, dtype=np.float32), {"ckpt": 2.0})
        c.insert(np.arange(3, dtype=np.float32) + 10, {"ckpt": 5.0})
        before = sample_one(c, "ckpt")
        path = c.checkpoint()
        assert isinstance(path, str) and path.startswith(str(tmp_path))
    finally:
        srv.stop()

    srv = reverb.Server([table.replace()], checkpointer=reverb.checkpointers.DefaultCheckpointer(path=str(tmp_path)))
    try:
        c = srv.localhost_client()
        info = c.server_info(timeout=PROMPT_S)["ckpt"]
        assert info.current_size == 2
        assert info.rate_limiter_info.insert_stats.completed == 2
        assert info.rate_limiter_info.sample_stats.completed == 1
        after = sample_one(c, "ckpt")
        assert after.info.key == before.info.key and after.info.priority == 5.0
        assert after.info.times_sampled == 2
        np.testing.assert_array_equal(after.data[0], before.data[0])
    finally:
        srv.stop()



@gear_only
def test_a_half_written_checkpoint_is_never_loaded(tmp_path):
    """A newer checkpoint without its completion marker (a crash while writing) is skipped."""
    import shutil

    table = reverb.Table("ckpt", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10, reverb.rate_limiters.MinSize(1))
    srv = reverb.Server([table], checkpointer=reverb.checkpointers.DefaultCheckpointer(path=str(tmp_path)))
    try:
        c = srv.localhost_client()
        c.insert(np.float32(1.0), {"ckpt": 1.0})
        good = c.checkpoint()
        c.insert(np.float32(2.0), {"ckpt": 1.0})
        newer = c.checkpoint()
    finally:
        srv.stop()
    # Make the newest checkpoint look half-written: no completion marker, a truncated file.
    (tmp_path / newer.rsplit("/", 1)[-1] / "COMPLETE").unlink()
    arrays = sorted((tmp_path / newer.rsplit("/", 1)[-1]).rglob("*.npy"))
    arrays[0].write_bytes(arrays[0].read_bytes()[:10])
    shutil.copytree(tmp_path / good.rsplit("/", 1)[-1], tmp_path / ".tmp-ckpt-999999-29991231T000000Z")

    srv = reverb.Server([table.replace()], checkpointer=reverb.checkpointers.DefaultCheckpointer(path=str(tmp_path)))
    try:
        c = srv.localhost_client()
        info = c.server_info(timeout=PROMPT_S)["ckpt"]
        assert info.current_size == 1
        assert float(sample_one(c, "ckpt").data[0][0]) == 1.0
    finally:
        srv.stop()
