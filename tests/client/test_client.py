"""Client and Server through `import gear_client as reverb`: a daemon child process on loopback.

The module's clients sample on the inline path (gRPC, ``data_planes=()``) so
these tests cover the Sample RPC end to end.
"""

from __future__ import annotations

import collections
import glob
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gear_client as reverb
from gear_contract import specs
from gear_contract._proto import replay_pb2 as pb
from gear_contract.wire import decode_sample_response

PROMPT_S = 10.0
Step = collections.namedtuple("Step", "obs extra")


def _tables():
    return [
        reverb.Table("uniform", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 1000,
                     reverb.rate_limiters.MinSize(1)),
        reverb.Table("nested", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 100,
                     reverb.rate_limiters.MinSize(1)),
        reverb.Table("signed", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 100,
                     reverb.rate_limiters.MinSize(1),
                     signature={"obs": specs.TensorSpec([None, 3], np.float32),
                                "act": specs.TensorSpec([None], np.int64)}),
        reverb.Table.queue("queue", 2),
        reverb.Table("prio", reverb.selectors.Prioritized(1.0), reverb.selectors.Fifo(), 100,
                     reverb.rate_limiters.MinSize(1)),
    ]


@pytest.fixture(scope="module")
def tables():
    return _tables()


@pytest.fixture(scope="module")
def server(tables):
    srv = reverb.Server(tables=tables, port=None)
    yield srv
    srv.stop()


@pytest.fixture
def client(server, tables):
    c = reverb.Client(f"localhost:{server.port}", data_planes=())
    for t in tables:
        c.reset(t.name)
    return c


# Tables without a signature fix their layout with the first item (kept across resets), so each
# test feeds a table the same kind of data: uniform float32[3], prio float32[2], queue int32[1].


def _size(client, table: str) -> int:
    return client.server_info(timeout=PROMPT_S)[table].current_size


# ------------------------------------------------------------------ data round trips

def test_insert_gains_a_time_dimension_and_nested_data_round_trips(client):
    data = Step(obs=np.arange(6, dtype=np.float32).reshape(2, 3), extra={"r": np.float64(1.5), "done": np.bool_(True)})
    client.insert(data, priorities={"nested": 1.0})

    flat = next(client.sample("nested", 1, emit_timesteps=False))
    assert isinstance(flat, reverb.ReplaySample) and isinstance(flat.info, reverb.SampleInfo)
    assert isinstance(flat.data, list) and len(flat.data) == 3  # Reverb: flat leaves in nest order
    np.testing.assert_array_equal(flat.data[0], data.obs[None])
    assert flat.data[1].shape == (1,) and bool(flat.data[1][0]) is True  # extra/done (keys sorted)
    assert flat.data[2].dtype == np.float64 and flat.data[2][0] == 1.5

    # the table has no signature: unpack_as_table_signature leaves the data flat, as Reverb does
    unpacked = next(client.sample("nested", 1, emit_timesteps=False, unpack_as_table_signature=True))
    assert isinstance(unpacked.data, list) and len(unpacked.data) == 3
    np.testing.assert_array_equal(unpacked.data[0][0], data.obs)
    unpacked.data[0][0, 0, 0] = 42.0  # sampled arrays are writable numpy arrays

    (step,) = next(client.sample("nested", 1))  # emit_timesteps: one step
    assert step.info.key == flat.info.key
    np.testing.assert_array_equal(step.data[0], data.obs)
    assert step.data[2] == 1.5


def test_trajectory_writer_items_sample_back_as_steps_and_as_trajectories(client):
    with client.trajectory_writer(4) as writer:
        for t in range(5):
            writer.append({"obs": np.full(3, t, np.float32), "act": np.int64(10 * t)})
            if t >= 2:
                writer.create_item("signed", priority=1.0,
                                   trajectory={"obs": writer.history["obs"][-3:], "act": writer.history["act"][-3:]})
        writer.flush()
    assert _size(client, "signed") == 3
    seen = set()
    for sample in client.sample("signed", 30, emit_timesteps=False, unpack_as_table_signature=True):
        obs, act = sample.data["obs"], sample.data["act"]
        assert obs.shape == (3, 3) and act.shape == (3,) and act.dtype == np.int64
        first = int(obs[0, 0])
        np.testing.assert_array_equal(act, [10 * first, 10 * (first + 1), 10 * (first + 2)])
        seen.add(first)
    assert seen == {0, 1, 2}
    steps = next(client.sample("signed", 1))
    assert len(steps) == 3 and all(s.info == steps[0].info for s in steps)
    assert [int(s.data[0]) // 10 for s in steps] == [int(s.data[1][0]) for s in steps]  # act, obs per step


def test_sample_infos_are_python_numbers_and_follow_the_selector(client):
    client.insert(np.zeros(2, np.float32), {"prio": 1.0})
    client.insert(np.ones(2, np.float32), {"prio": 3.0})
    infos = [s.info for s in client.sample("prio", 400, emit_timesteps=False)]
    assert all(type(i.key) is int and type(i.probability) is float and type(i.table_size) is int for i in infos)
    by_priority = collections.Counter(i.priority for i in infos)
    assert {i.probability for i in infos if i.priority == 3.0} == {0.75}
    assert 0.65 < by_priority[3.0] / 400 < 0.85
    assert max(i.times_sampled for i in infos) > 1


def test_sample_blocks_until_the_rate_limiter_allows(client):
    got = []
    sampler = threading.Thread(target=lambda: got.append(next(client.sample("queue", 1, emit_timesteps=False))))
    sampler.start()
    sampler.join(0.4)
    assert sampler.is_alive(), "a sample went through an empty queue"
    client.insert(np.array([7], np.int32), {"queue": 1.0})
    sampler.join(PROMPT_S)
    assert not sampler.is_alive() and int(got[0].data[0][0, 0]) == 7
    assert _size(client, "queue") == 0  # max_times_sampled = 1


def test_mutate_priorities_and_reset(client):
    client.insert(np.zeros(2, np.float32), {"prio": 1.0})
    client.insert(np.ones(2, np.float32), {"prio": 1.0})
    keys = {s.info.key for s in client.sample("prio", 50, emit_timesteps=False)}
    assert len(keys) == 2
    low, high = sorted(keys)
    client.mutate_priorities("prio", updates={low: 0.0, 12345: 1.0}, deletes=[98765])
    assert {s.info.key for s in client.sample("prio", 20, emit_timesteps=False)} == {high}
    client.mutate_priorities("prio", deletes=[high])
    assert _size(client, "prio") == 1
    client.reset("prio")
    info = client.server_info(timeout=PROMPT_S)["prio"]
    assert info.current_size == 0 and info.rate_limiter_info.num_deletes == 0


def test_server_info_fields(client):
    info = client.server_info(timeout=PROMPT_S)["signed"]
    assert isinstance(info, reverb.TableInfo) and info.name == "signed" and info.max_size == 100
    assert info.sampler_options.uniform and info.remover_options.fifo
    assert set(info.signature) == {"obs", "act"} and info.signature["obs"].shape == (None, 3)
    assert info.max_times_sampled == 0 and info.current_size == 0
    assert info.rate_limiter_info.min_size_to_sample == 1
    for field in ("num_episodes", "num_deleted_episodes", "num_unique_samples", "table_worker_time"):
        assert hasattr(info, field)
    assert client.server_info()["queue"].max_times_sampled == 1


def test_server_info_deadline_when_nothing_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        started = time.monotonic()
        with pytest.raises(reverb.DeadlineExceededError):
            reverb.Client(f"127.0.0.1:{port}").server_info(timeout=0.3)
        assert time.monotonic() - started < 5


# ------------------------------------------------------------------ errors

def test_errors_name_the_problem_and_the_server_keeps_serving(client):
    client.insert(np.zeros(3, np.float32), {"uniform": 1.0})
    with pytest.raises(RuntimeError, match="nope"):
        next(client.sample("nope", 1))
    with pytest.raises(RuntimeError, match="nope"):
        client.mutate_priorities("nope", {1: 1.0})
    with pytest.raises(RuntimeError, match="nope"):
        client.reset("nope")
    with pytest.raises(ValueError, match="nope"):
        client.insert(np.zeros(3), {"nope": 1.0})
    with pytest.raises(ValueError, match="priorities"):
        client.insert(np.zeros(3), {})
    with pytest.raises(ValueError, match="NaN"):
        client.insert(np.zeros(2, np.float32), {"prio": float("nan")})
    with pytest.raises(ValueError, match="negative"):
        client.insert(np.zeros(2, np.float32), {"prio": -1.0})
    with pytest.raises(ValueError, match="dtype"):
        client.insert({"obs": np.zeros(3, np.float64), "act": np.int64(1)}, {"signed": 1.0})
    with pytest.raises(ValueError, match="object dtype"):
        client.insert([object()], {"uniform": 1.0})
    with pytest.raises(ValueError, match="empty"):
        client.insert({}, {"uniform": 1.0})
    with pytest.raises(ValueError, match="priority"):
        client.mutate_priorities("prio", {1: float("nan")})
    with pytest.raises(ValueError):
        client.trajectory_writer(0)
    with pytest.raises(ValueError):
        client.writer(0)
    with pytest.raises(ValueError):
        client.writer(3, chunk_length=4)
    info = client.server_info(timeout=PROMPT_S)
    assert info["uniform"].current_size == 1 and info["signed"].current_size == 0 and info["prio"].current_size == 0


def test_decode_refuses_truncated_responses(client):
    client.insert(np.arange(3, dtype=np.float32), {"uniform": 1.0})
    sample_call = client._connect()[2]  # the raw Sample call: serialized responses
    raw = next(iter(sample_call(pb.SampleRequest(table="uniform", num_samples=1), timeout=PROMPT_S)))
    assert decode_sample_response(raw).columns[0].tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError):
        decode_sample_response(raw[:-3])


# ------------------------------------------------------------------ sharing

def test_client_pickles_and_works_in_another_process(client):
    blob = pickle.dumps(client)
    code = ("import pickle, sys, numpy as np; c = pickle.loads(sys.stdin.buffer.read()); "
            "c.insert(np.full(3, 9.0, np.float32), {'uniform': 2.0}); print(c.server_address)")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().strip() == client.server_address
    (sample,) = client.sample("uniform", 1, emit_timesteps=False)
    assert sample.info.priority == 2.0 and sample.data[0].tolist() == [[9.0, 9.0, 9.0]]
    clone = pickle.loads(blob)
    assert clone.server_info(timeout=PROMPT_S)["uniform"].current_size == 1


def test_one_client_used_from_several_threads(client):
    errors = []

    def work(i: int) -> None:
        try:
            for k in range(20):
                client.insert(np.full(3, i * 100 + k, np.float32), {"uniform": 1.0})
                if k % 5 == 0:
                    for s in client.sample("uniform", 3, emit_timesteps=False):
                        assert s.data[0].shape == (1, 3)
        except Exception as e:  # noqa: BLE001 (collected and asserted below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert _size(client, "uniform") == 80


# ------------------------------------------------------------------ Server and Table

def test_tables_bound_to_a_server_report_its_state(client, tables):
    queue = next(t for t in tables if t.name == "queue")
    assert queue.info.current_size == 0 and not queue.can_sample(1) and queue.can_insert(2)
    client.insert(np.zeros(1, np.int32), {"queue": 1.0})
    client.insert(np.zeros(1, np.int32), {"queue": 1.0})
    assert queue.info.current_size == 2 and queue.can_sample(2) and not queue.can_sample(3)
    assert not queue.can_insert(1)  # Queue(2) is full


def test_server_child_process_lifecycle_frees_everything():
    server = reverb.Server([reverb.Table.stack("s", 10)])
    pid, port = server.pid, server.port
    assert pid != os.getpid() and port > 0
    checkpoint_dir = server._owned_checkpoint_dir  # Reverb's default: a temporary checkpointer
    assert checkpoint_dir and os.path.isdir(checkpoint_dir)
    client = server.localhost_client()
    client.insert(np.arange(3), {"s": 1.0})
    assert glob.glob(f"/dev/shm/gear.*.{pid}.*"), "the table's segment should exist while serving"
    server.stop()
    server.stop()  # idempotent
    assert glob.glob(f"/dev/shm/gear.*.{pid}.*") == []
    assert not os.path.exists(checkpoint_dir)  # nothing was checkpointed: the empty directory is removed
    with pytest.raises(OSError):
        os.kill(pid, 0)  # the child is gone (and reaped)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port is free again


def test_server_validates_tables_and_reports_a_taken_port():
    with pytest.raises(ValueError, match="At least one table"):
        reverb.Server(tables=[])
    with pytest.raises(ValueError, match="same name"):
        reverb.Server(tables=[reverb.Table.queue("x", 1), reverb.Table.stack("x", 1)])
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="bind"):
            reverb.Server([reverb.Table.queue("q", 1)], port=s.getsockname()[1])


def test_in_process_server_context_manager_and_wait():
    with reverb.Server([reverb.Table.queue("q", 3)], in_process=True) as server:
        assert server.pid == os.getpid()
        client = server.localhost_client()
        client.insert(np.zeros(2), {"q": 1.0})
        assert server.localhost_client().server_info()["q"].current_size == 1
        stopper = threading.Timer(0.3, server.stop)
        stopper.start()
        started = time.monotonic()
        server.wait()
        assert 0.2 < time.monotonic() - started < PROMPT_S


def test_table_definitions_validate_like_reverb():
    rl = reverb.rate_limiters
    with pytest.raises(ValueError):
        reverb.Table("", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10, rl.MinSize(1))
    with pytest.raises(ValueError):
        reverb.Table("t", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 0, rl.MinSize(1))
    with pytest.raises(ValueError):
        reverb.Table("t", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10, rl.MinSize(1),
                     signature={"x": object()})
    queue = reverb.Table.queue("q", 5).to_proto()
    assert queue.sampler.fifo and queue.remover.fifo and queue.max_times_sampled == 1
    assert (queue.rate_limiter.min_diff, queue.rate_limiter.max_diff) == (0.0, 5.0)
    stack = reverb.Table.stack("s", 5).to_proto()
    assert stack.sampler.lifo and stack.remover.lifo
    bigger = reverb.Table.queue("q", 5).replace(name="r", max_size=9).to_proto()
    assert (bigger.name, bigger.max_size, bigger.max_times_sampled) == ("r", 9, 1)
    for bad in (lambda: rl.MinSize(0), lambda: rl.SampleToInsertRatio(1.0, 10, 0.5),
                lambda: rl.SampleToInsertRatio(2.0, 1, (5.0, 10.0)), lambda: rl.SampleToInsertRatio(1.0, 0, 5.0),
                lambda: rl.SampleToInsertRatio(0.0, 1, 5.0), lambda: reverb.selectors.Prioritized(-1.0)):
        with pytest.raises(ValueError):
            bad()
    ratio = rl.SampleToInsertRatio(1.5, 2, 2.0).to_proto()
    assert (ratio.min_diff, ratio.max_diff) == (1.0, 5.0)
    assert reverb.selectors.MinHeap().to_proto().heap.min_heap
    assert reverb.selectors.Prioritized(0.6).to_proto().prioritized.priority_exponent == 0.6


def test_a_pickled_client_keeps_its_connect_timeout(monkeypatch):
    monkeypatch.delenv("GEAR_CONNECT_TIMEOUT", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket is closed
    for timeout in (0.5, -1):
        clone = pickle.loads(pickle.dumps(reverb.Client(address, connect_timeout=timeout, data_planes=())))
        assert clone._connect_timeout == (None if timeout == -1 else timeout)
    start = time.monotonic()
    with pytest.raises(reverb.errors.ConnectError, match="within 0.5 s"):
        pickle.loads(pickle.dumps(reverb.Client(address, connect_timeout=0.5, data_planes=()))).server_info()
    assert time.monotonic() - start < 5
