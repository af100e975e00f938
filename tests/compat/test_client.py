"""Client: insert, sample, mutate_priorities, reset, server_info, pickling, threads, processes."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import pickle
import socket
import threading
import time

import numpy as np
import pytest

from tests.support.compat import BACKEND, PROMPT_S, info_of, reverb, sample_one, sampled_keys, spec


def test_insert_needs_priorities(client):
    with pytest.raises(ValueError):
        client.insert(np.zeros(2), {})
    assert info_of(client, "uniform").current_size == 0


def test_insert_adds_a_leading_time_dimension_of_one(client):
    data = {"obs": np.arange(6, dtype=np.float32).reshape(2, 3), "act": np.int64(4)}
    client.insert(data, {"uniform": 1.0})
    whole = sample_one(client, "uniform")
    # Flat leaves in sorted-key order: act, obs.
    assert [x.shape for x in whole.data] == [(1,), (1, 2, 3)]
    assert whole.data[0].dtype == np.int64 and whole.data[1].dtype == np.float32
    np.testing.assert_array_equal(whole.data[1][0], data["obs"])

    [steps] = list(client.sample("uniform", 1, emit_timesteps=True))
    assert len(steps) == 1
    assert steps[0].data[1].shape == (2, 3) and int(steps[0].data[0]) == 4


def test_insert_into_several_tables_at_once(client):
    client.insert(np.float32(3.0), {"uniform": 1.0, "fifo": 2.0, "max_heap": 3.0})
    infos = client.server_info(timeout=PROMPT_S)
    assert [infos[t].current_size for t in ("uniform", "fifo", "max_heap")] == [1, 1, 1]
    assert sample_one(client, "max_heap").info.priority == 3.0


def test_sample_is_a_generator_of_num_samples(client):
    for i in range(3):
        client.insert(np.int64(i), {"uniform": 1.0})
    gen = client.sample("uniform", 5, emit_timesteps=False)
    assert inspect.isgenerator(gen)
    got = list(gen)
    assert len(got) == 5
    assert all(isinstance(s, reverb.ReplaySample) for s in got)


def test_sample_emit_timesteps_splits_writer_trajectories(client):
    with client.trajectory_writer(4) as writer:
        for t in range(4):
            writer.append({"obs": np.full(2, t, np.float32), "t": np.int32(t)})
        writer.create_item("uniform", 1.0, {"obs": writer.history["obs"][-3:], "t": writer.history["t"][-3:]})
    [steps] = list(client.sample("uniform", 1))  # emit_timesteps=True by default
    assert len(steps) == 3
    assert [int(s.data[1]) for s in steps] == [1, 2, 3]
    assert all(s.data[0].shape == (2,) for s in steps)
    assert len({s.info.key for s in steps}) == 1

    whole = sample_one(client, "uniform")
    assert whole.data[0].shape == (3, 2) and list(whole.data[1]) == [1, 2, 3]


def test_emit_timesteps_refuses_columns_of_different_lengths(client):
    with client.trajectory_writer(3) as writer:
        for t in range(3):
            writer.append({"a": np.int32(t), "b": np.int32(t)})
        writer.create_item("uniform", 1.0, {"a": writer.history["a"][-3:], "b": writer.history["b"][-1:]})
    with pytest.raises(ValueError):
        list(client.sample("uniform", 1, emit_timesteps=True))


def test_sample_unpacks_as_table_signature(client):
    with client.trajectory_writer(2) as writer:
        for t in range(2):
            writer.append({"obs": np.full(2, t, np.float32), "act": np.int64(10 + t)})
        writer.create_item("signed", 1.0, {"obs": writer.history["obs"][-2:], "act": writer.history["act"][-2:]})
    packed = next(client.sample("signed", 1, emit_timesteps=False, unpack_as_table_signature=True))
    assert set(packed.data) == {"obs", "act"}
    assert packed.data["obs"].shape == (2, 2) and list(packed.data["act"]) == [10, 11]
    flat = next(client.sample("signed", 1, emit_timesteps=False))
    assert isinstance(flat.data, list) and len(flat.data) == 2
    [steps] = list(client.sample("signed", 1, unpack_as_table_signature=True))
    assert [int(s.data["act"]) for s in steps] == [10, 11]


def test_mutate_priorities_updates_and_deletes(client):
    for i in range(3):
        client.insert(np.int64(i), {"max_heap": 1.0 + i})
    top = sample_one(client, "max_heap")
    assert int(top.data[0][0]) == 2
    client.mutate_priorities("max_heap", updates={top.info.key: 0.1})
    nxt = sample_one(client, "max_heap")
    assert int(nxt.data[0][0]) == 1
    client.mutate_priorities("max_heap", deletes=[nxt.info.key])
    assert info_of(client, "max_heap").current_size == 2


def test_mutate_priorities_deletes_first_then_updates(client):
    client.insert(np.int64(0), {"fifo": 1.0})
    client.insert(np.int64(1), {"fifo": 1.0})
    key = sample_one(client, "fifo").info.key
    client.mutate_priorities("fifo", updates={key: 5.0}, deletes=[key])
    info = info_of(client, "fifo")
    assert info.current_size == 1
    assert int(sample_one(client, "fifo").data[0][0]) == 1


def test_mutate_priorities_ignores_unknown_keys(client):
    client.insert(np.int64(0), {"fifo": 1.0})
    key = sample_one(client, "fifo").info.key
    unknown = (key + 12345) % (2**63)
    client.mutate_priorities("fifo", updates={unknown: 2.0, key: 3.0}, deletes=[unknown + 1])
    s = sample_one(client, "fifo")
    assert s.info.key == key and s.info.priority == 3.0 and s.info.table_size == 1
    client.mutate_priorities("fifo")  # nothing to do


def test_reset_empties_the_table_and_zeroes_counters(client, table_by_name):
    keys = set()
    for i in range(3):
        client.insert(np.int64(i), {"uniform": 1.0})
    keys.update(sampled_keys(client, "uniform", 30))
    client.reset("uniform")
    info = info_of(client, "uniform")
    assert info.current_size == 0
    assert info.rate_limiter_info.insert_stats.completed == 0
    assert info.rate_limiter_info.sample_stats.completed == 0
    assert not table_by_name["uniform"].can_sample(1)
    client.insert(np.int64(9), {"uniform": 1.0})
    s = sample_one(client, "uniform")
    assert int(s.data[0][0]) == 9 and s.info.key not in keys


def test_reset_of_one_table_leaves_the_others(client):
    client.insert(np.int64(0), {"uniform": 1.0, "fifo": 1.0})
    client.reset("uniform")
    assert info_of(client, "fifo").current_size == 1


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_server_info_times_out_on_an_unreachable_server():
    client = reverb.Client(f"localhost:{_unused_port()}")
    start = time.monotonic()
    with pytest.raises(reverb.DeadlineExceededError):
        client.server_info(timeout=1)
    assert time.monotonic() - start < 5


def test_server_info_times_out_on_a_stopped_server():
    srv = reverb.Server([reverb.Table("t", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 5,
                                      reverb.rate_limiters.MinSize(1))])
    client = srv.localhost_client()
    assert "t" in client.server_info(timeout=PROMPT_S)
    srv.stop()
    start = time.monotonic()
    # Reverb answers a connection refused at once with a RuntimeError; a deadline is as good.
    with pytest.raises((reverb.DeadlineExceededError, RuntimeError)):
        client.server_info(timeout=1)
    assert time.monotonic() - start < 5


def test_client_pickles(client):
    clone = pickle.loads(pickle.dumps(client))
    clone.insert(np.int64(5), {"uniform": 1.0})
    assert int(sample_one(client, "uniform").data[0][0]) == 5


def _insert_from_child(pickled_client: bytes, n: int) -> None:
    c = pickle.loads(pickled_client)
    for i in range(n):
        c.insert(np.int64(i), {"fifo": 1.0})


@pytest.mark.skipif(BACKEND == "reverb", reason="spawning TensorFlow children is slow; same code path as gear")
def test_client_sent_to_a_spawned_process(client):
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_insert_from_child, args=(pickle.dumps(client), 4))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert info_of(client, "fifo").current_size == 4


def test_several_threads_share_a_client(client):
    errors: list[BaseException] = []

    def insert(base: int) -> None:
        try:
            for i in range(20):
                client.insert(np.int64(base + i), {"uniform": 1.0})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def sample() -> None:
        try:
            for s in client.sample("uniform", 20, emit_timesteps=False):
                assert 0 <= int(s.data[0][0]) < 80
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    inserters = [threading.Thread(target=insert, args=(20 * k,), daemon=True) for k in range(4)]
    samplers = [threading.Thread(target=sample, daemon=True) for _ in range(2)]
    for t in samplers + inserters:
        t.start()
    for t in inserters:
        t.join(PROMPT_S * 3)
    assert errors == [] and not any(t.is_alive() for t in inserters)
    for t in samplers:
        t.join(PROMPT_S * 3)
    assert errors == [] and not any(t.is_alive() for t in samplers)
    info = info_of(client, "uniform")
    assert info.current_size == 80 and info.rate_limiter_info.sample_stats.completed == 40


def test_writer_factories_validate_arguments(client):
    with pytest.raises(ValueError):
        client.trajectory_writer(0)
    with pytest.raises(ValueError):
        client.writer(0)
    with pytest.raises(ValueError):
        client.writer(3, chunk_length=4)
    with pytest.raises(ValueError):
        client.writer(3, chunk_length=0)
    with pytest.raises(ValueError):
        client.writer(3, max_in_flight_items=0)


@pytest.mark.parametrize("planes", [None, ()], ids=["default-planes", "inline"])
def test_insert_is_checked_on_the_flattened_leaves_of_the_signature(planes):
    """Reverb compares flattened leaves, each as one step or as the whole trajectory."""
    server = reverb.Server([reverb.Table.queue("scalar", 10, signature=spec((), np.int64)),
                            reverb.Table.queue("one", 10, signature=spec((1,), np.int64))])
    try:
        kwargs = {} if BACKEND == "reverb" or planes is None else {"data_planes": planes}
        client = reverb.Client(f"localhost:{server.port}", **kwargs)
        client.insert(1, {"scalar": 1.0})                 # a step of shape [] into TensorSpec([])
        client.insert([np.int64(5)], {"one": 1.0})        # a list of one leaf into a bare TensorSpec([1])
        flat = next(client.sample("scalar", 1, emit_timesteps=False))
        assert [int(x) for x in flat.data[0]] == [1]
        packed = next(client.sample("one", 1, emit_timesteps=False, unpack_as_table_signature=True))
        assert isinstance(packed.data, np.ndarray) and packed.data.tolist() == [5]  # the signature's structure
        with pytest.raises(ValueError):
            client.insert(np.float32(1.0), {"scalar": 1.0})  # the dtype still counts
        assert info_of(client, "scalar").current_size == 0 and info_of(client, "one").current_size == 0
    finally:
        server.stop()


@pytest.mark.parametrize("planes", [None, ()], ids=["default-planes", "inline"])
def test_a_signature_of_one_step_takes_legacy_writer_items_of_any_length(planes):
    """A signature leaf of a step's rank describes one step (Reverb's legacy Writer and ``insert``): items of
    3 steps and of 1 fit, and come back with their own time dimension, not padded to the spec's first
    dimension."""
    server = reverb.Server([reverb.Table.queue("steps", 10, signature={"x": spec((2,), np.float32)}),
                            reverb.Table.queue("vec", 10, signature={"x": spec((3,), np.float32)})])
    try:
        kwargs = {} if BACKEND == "reverb" or planes is None else {"data_planes": planes}
        client = reverb.Client(f"localhost:{server.port}", **kwargs)
        with client.writer(5) as writer:
            for t in range(4):
                writer.append({"x": np.full(2, t, np.float32)})
            writer.create_item("steps", 3, 1.0)
            writer.create_item("steps", 1, 1.0)
        three = sample_one(client, "steps")
        assert np.asarray(three.data[0]).tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
        one = sample_one(client, "steps", unpack_as_table_signature=True)
        assert np.asarray(one.data["x"]).tolist() == [[3.0, 3.0]]
        client.insert({"x": np.arange(3, dtype=np.float32)}, {"vec": 1.0})
        assert np.asarray(sample_one(client, "vec").data[0]).tolist() == [[0.0, 1.0, 2.0]]
    finally:
        server.stop()


def test_sample_of_a_queue_takes_one_item_per_next(client):
    """``client.sample(queue, num_samples=N)`` hands items over as they come: one ``next()`` takes one item
    (Reverb's sampler asks for one at a time), so items the caller never gets stay in the queue."""
    for i in range(8):
        client.insert(np.int64(i), {"queue": 1.0})
    samples = client.sample("queue", num_samples=5, emit_timesteps=False)
    first = next(samples)
    assert int(np.asarray(first.data[0]).reshape(-1)[0]) == 0
    assert info_of(client, "queue").current_size == 7
    del samples
    assert info_of(client, "queue").current_size == 7
