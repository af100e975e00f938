"""TrajectoryWriter against a real gRPC server on loopback running a recording servicer.

The servicer keeps each stream's chunks until released, assembles every item
from its slices (aborting on an unknown chunk, a duplicate chunk or a release
of an unknown chunk), and acknowledges keys, so these tests check the wire
encoding, that each step is sent once, releases, back-pressure and errors.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc
import numpy as np
import pytest

from gear_client.errors import DeadlineExceededError
from gear_client.writers.trajectory_writer import TrajectoryColumn, TrajectoryWriter
from gear_contract._proto import replay_pb2 as pb
from gear_contract.specs import TensorSpec, signature_to_proto
from tests.support.recording import FakeClient, LoopbackServer

pytestmark = pytest.mark.timeout(60)

Step = collections.namedtuple("Step", ["obs", "reward"])


@pytest.fixture
def client(server):
    signature = signature_to_proto({"obs": TensorSpec([None, 3], np.float32), "r": TensorSpec([], np.int64)})
    c = FakeClient(server.address, {
        "t": pb.TableInfo(name="t"),
        "bad": pb.TableInfo(name="bad"),
        "typed": pb.TableInfo(name="typed", signature=signature),
    })
    yield c
    c.close()


def obs(i: int) -> np.ndarray:
    return np.arange(3, dtype=np.float32) + 10 * i


def test_items_carry_the_referenced_steps(server, client):
    with TrajectoryWriter(client, 8) as w:
        for i in range(6):
            w.append({"obs": obs(i), "r": np.int64(i)})
        w.create_item("t", 0.5, {"obs": w.history["obs"][-3:], "r": w.history["r"][-1]})
        w.create_item("t", 2.0, {"first_last": w.history["obs"][[0, -1]], "mid": w.history["r"][2:4]})
        w.flush()
    a, b = server.servicer.items
    assert a.table == "t" and a.priority == 0.5
    np.testing.assert_array_equal(a.data["obs"], np.stack([obs(3), obs(4), obs(5)]))
    assert a.data["r"].shape == () and a.data["r"] == 5  # squeezed single step
    np.testing.assert_array_equal(b.data["first_last"], np.stack([obs(0), obs(5)]))
    np.testing.assert_array_equal(b.data["mid"], np.array([2, 3]))
    assert a.key != b.key


def test_each_step_is_sent_once_and_chunks_are_released(server, client):
    keep, length, steps = 5, 3, 40
    w = TrajectoryWriter(client, keep)
    for i in range(steps):
        w.append({"obs": obs(i), "r": np.int64(i)})
        if w.episode_steps >= length:
            w.create_item("t", 1.0, {"obs": w.history["obs"][-length:], "r": w.history["r"][-length:]})
    w.flush()
    items = server.servicer.items
    assert len(items) == steps - length + 1
    for n, item in enumerate(items):
        np.testing.assert_array_equal(item.data["r"], np.arange(n, n + length))
        np.testing.assert_array_equal(item.data["obs"], np.stack([obs(i) for i in range(n, n + length)]))
    chunks = server.servicer.chunk_messages()
    rows_sent = collections.Counter()
    for c in chunks:
        rows_sent[c.data.dtype] += c.data.shape[0]
    assert rows_sent == {"<f4": steps, "<i8": steps}  # every step of each column exactly once
    assert len({c.chunk_key for c in chunks}) == len(chunks)
    released = server.servicer.released_keys()
    assert len(set(released)) == len(released)
    # Everything but the chunks still within the keep-alive window was released.
    assert len(chunks) - len(released) <= 2 * keep
    w.end_episode()
    w.close()
    assert sorted(server.servicer.released_keys()) == sorted(c.chunk_key for c in chunks)
    assert server.servicer.live_chunks_at_end == [0]


def test_episode_steps_in_chunks(server, client):
    w = TrajectoryWriter(client, 4)
    for i in range(3):
        w.append({"r": np.int64(i)})
    w.create_item("t", 1.0, w.history["r"][1:])
    w.end_episode()
    for i in range(2):
        w.append({"r": np.int64(100 + i)})
    w.create_item("t", 1.0, w.history["r"][:])
    w.flush()
    chunks = server.servicer.chunk_messages()
    assert [(c.episode_step, c.data.shape[0]) for c in chunks] == [(1, 2), (0, 2)]
    assert chunks[0].episode_id != chunks[1].episode_id
    first, second = server.servicer.items
    assert first.episode_ids != second.episode_ids
    np.testing.assert_array_equal(second.data, [100, 101])
    w.close()


def test_clear_buffers_false_allows_items_across_episodes(server, client):
    w = TrajectoryWriter(client, 10)
    w.append({"r": np.int64(1)})
    w.append({"r": np.int64(2)})
    w.end_episode(clear_buffers=False)
    assert w.episode_steps == 0 and len(w.history["r"]) == 2
    w.append({"r": np.int64(3)})
    w.create_item("t", 1.0, w.history["r"][:])
    w.flush()
    (item,) = server.servicer.items
    np.testing.assert_array_equal(item.data, [1, 2, 3])
    assert len(item.episode_ids) == 2
    w.close()


def test_end_episode_clears_history(server, client):
    w = TrajectoryWriter(client, 10)
    w.append({"r": np.int64(1)})
    old = w.history["r"][-1:]
    w.end_episode()
    assert w.episode_steps == 0 and len(w.history["r"]) == 0
    with pytest.raises(ValueError, match="expired"):
        w.create_item("t", 1.0, old)
    w.close()


def test_namedtuples_and_nested_structures(server, client):
    w = TrajectoryWriter(client, 4)
    for i in range(2):
        w.append(Step(obs={"pixels": obs(i)}, reward=np.float32(i)))
    h = w.history
    assert isinstance(h, Step)
    w.create_item("t", 1.0, Step(obs=h.obs["pixels"][:], reward=h.reward[-1]))
    w.flush()
    (item,) = server.servicer.items
    assert type(item.data).__name__ == "Step"
    np.testing.assert_array_equal(item.data.obs, np.stack([obs(0), obs(1)]))
    assert item.data.reward == np.float32(1)
    w.close()


def test_structure_grows_and_pads_history_with_none(client):
    w = TrajectoryWriter(client, 8)
    w.append({"a": np.int64(0)})
    w.append({"a": np.int64(1), "b": np.float32(1)})
    w.append({"b": np.float32(2)})
    h = w.history
    assert set(h) == {"a", "b"} and len(h["a"]) == len(h["b"]) == 3
    with pytest.raises(ValueError, match="None"):
        h["b"][0]
    with pytest.raises(ValueError, match="None"):
        h["a"][:]
    np.testing.assert_array_equal(h["b"][1:].numpy(), np.float32([1, 2]))
    np.testing.assert_array_equal(h["a"][:2].numpy(), [0, 1])
    assert h["a"][1].numpy() == 1 and h["a"][1].shape == ()
    w.close()


def test_partial_steps(server, client):
    w = TrajectoryWriter(client, 4)
    w.append({"obs": obs(0)}, partial_step=True)
    assert w.episode_steps == 0
    with pytest.raises(ValueError, match="already been set"):
        w.append({"obs": obs(1)})
    w.append({"action": np.int64(7)})
    assert w.episode_steps == 1
    w.append({"obs": obs(1), "action": np.int64(8)})
    h = w.history
    assert len(h["obs"]) == 2
    np.testing.assert_array_equal(h["action"][:].numpy(), [7, 8])
    np.testing.assert_array_equal(h["obs"][:].numpy(), np.stack([obs(0), obs(1)]))
    w.close()


def test_dtype_and_shape_changes_name_the_column(client):
    w = TrajectoryWriter(client, 4)
    w.append({"obs": {"pixels": obs(0)}})
    with pytest.raises(ValueError, match=r"\['obs'\]\['pixels'\].*float64"):
        w.append({"obs": {"pixels": obs(1).astype(np.float64)}})
    with pytest.raises(ValueError, match=r"\['obs'\]\['pixels'\].*\(4,\)"):
        w.append({"obs": {"pixels": np.zeros(4, np.float32)}})
    # The failed appends changed nothing.
    assert w.episode_steps == 1
    w.append({"obs": {"pixels": obs(1)}})
    assert len(w.history["obs"]["pixels"]) == 2
    w.close()


def test_fast_path_falls_back_to_checks(client):
    w = TrajectoryWriter(client, 4)
    w.append({"x": np.float64(1.0), "y": np.zeros(2, np.int32)})
    w.append({"x": 2.0, "y": np.ones(2, np.int32)})  # Python float is float64: accepted
    with pytest.raises(ValueError, match=r"\['y'\]"):
        w.append({"x": 3.0, "y": np.ones(3, np.int32)})
    with pytest.raises(ValueError, match=r"\['x'\]"):
        w.append({"x": np.float32(3.0), "y": np.ones(2, np.int32)})
    np.testing.assert_array_equal(w.history["x"][:].numpy(), [1.0, 2.0])
    w.close()


def test_create_item_argument_errors(client):
    w = TrajectoryWriter(client, 2)
    for i in range(4):
        w.append({"r": np.int64(i)})
    col = w.history["r"][-1:]
    with pytest.raises(TypeError, match="TrajectoryColumn"):
        w.create_item("t", 1.0, {"r": np.zeros(2)})
    with pytest.raises(ValueError, match="empty"):
        w.create_item("t", 1.0, {"r": w.history["r"][4:]})
    with pytest.raises(ValueError):
        w.create_item("t", 1.0, {})
    with pytest.raises(ValueError, match="NaN"):
        w.create_item("t", float("nan"), col)
    with pytest.raises(ValueError, match="nope"):
        w.create_item("nope", 1.0, col)
    with pytest.raises(ValueError, match="None"):  # beyond the keep-alive window of the history
        w.history["r"][0]
    w.append({"r": np.int64(9)})
    w.append({"r": np.int64(10)})
    with pytest.raises(ValueError, match="expired"):
        w.create_item("t", 1.0, col)
    with pytest.raises(RuntimeError, match="expired"):
        col.numpy()
    w.close()


def test_references_build_columns(server, client):
    w = TrajectoryWriter(client, 4)
    w.append({"a": np.int64(1), "b": np.int64(2)})
    w.append({"a": np.int64(3), "b": np.int64(4)})
    refs_a, refs_b = list(w.history["a"][:]), list(w.history["b"][:])
    assert not refs_a[0].expired and refs_a[1].numpy() == 3
    mixed = TrajectoryColumn([refs_a[0], refs_b[1], refs_a[1]])
    assert mixed.shape == (3,) and mixed.dtype == np.int64
    np.testing.assert_array_equal(mixed.numpy(), [1, 4, 3])
    w.create_item("t", 1.0, {"mixed": mixed, "sub": w.history["a"][:][1]})
    w.flush()
    (item,) = server.servicer.items
    np.testing.assert_array_equal(item.data["mixed"], [1, 4, 3])
    assert item.data["sub"] == 3
    with pytest.raises(ValueError, match="None"):
        TrajectoryColumn([None])
    with pytest.raises(ValueError, match="exactly one"):
        TrajectoryColumn(refs_a, squeeze=True)
    w.close()


def test_signature_is_checked_before_sending(server, client):
    w = TrajectoryWriter(client, 4)
    for i in range(3):
        w.append({"obs": obs(i), "r": np.int64(i), "f": np.float32(i)})
    h = w.history
    w.create_item("typed", 1.0, {"obs": h["obs"][:], "r": h["r"][-1]})
    with pytest.raises(ValueError, match="typed"):
        w.create_item("typed", 1.0, {"obs": h["obs"][:], "r": h["f"][-1]})  # float32 where int64 expected
    with pytest.raises(ValueError, match="typed"):
        w.create_item("typed", 1.0, {"obs": h["obs"][-1], "r": h["r"][-1]})  # squeezed: rank 1, not 2
    with pytest.raises(ValueError, match="columns"):
        w.create_item("typed", 1.0, {"obs": h["obs"][:]})
    w.flush()
    assert len(server.servicer.items) == 1
    w.close()


def test_validate_items_false_skips_table_lookups(server, client):
    w = TrajectoryWriter(client, 4, validate_items=False)
    w.append({"r": np.int64(1)})
    w.create_item("unknown-to-the-client", 1.0, w.history["r"][:])
    w.flush()
    assert client.info_calls == 0
    assert server.servicer.items[0].table == "unknown-to-the-client"
    w.close()


def test_server_error_surfaces_as_reverb_type_and_writer_recovers(server, client):
    server.servicer.abort_on_table["bad"] = (grpc.StatusCode.INVALID_ARGUMENT, "item rejected by bad")
    w = TrajectoryWriter(client, 8)
    for i in range(4):
        w.append({"r": np.int64(i)})
    w.create_item("t", 1.0, w.history["r"][-2:])
    w.create_item("bad", 1.0, w.history["r"][-2:])
    with pytest.raises(ValueError, match="rejected by bad"):
        w.flush()
    # A new stream: the data the next item needs is sent again.
    w.create_item("t", 1.0, w.history["r"][-3:])
    w.flush()
    assert server.servicer.streams_opened == 2
    np.testing.assert_array_equal(server.servicer.items[-1].data, [1, 2, 3])
    w.close()


def test_not_found_on_insert_is_value_error(server, client):
    server.servicer.abort_on_table["gone"] = (grpc.StatusCode.NOT_FOUND, "Table 'gone' not found")
    w = TrajectoryWriter(client, 4, validate_items=False)
    w.append({"r": np.int64(1)})
    w.create_item("gone", 1.0, w.history["r"][:])
    with pytest.raises(ValueError, match="gone"):
        w.flush()
    w.close()


def test_back_pressure_and_flush_timeout(server, client):
    server.servicer.ack_gate = threading.Semaphore(0)
    w = TrajectoryWriter(client, 8, max_in_flight_items=2)
    for i in range(4):
        w.append({"r": np.int64(i)})
    w.create_item("t", 1.0, w.history["r"][-1])
    w.create_item("t", 1.0, w.history["r"][-2])
    with pytest.raises(DeadlineExceededError):
        w.flush(timeout_ms=100)
    w.flush(block_until_num_items=2, timeout_ms=100)  # two in flight is allowed
    done = threading.Event()

    def third():
        w.create_item("t", 1.0, w.history["r"][-3])
        done.set()

    t = threading.Thread(target=third)
    t.start()
    assert not done.wait(0.3)  # blocked: two items unacknowledged
    server.servicer.ack_gate.release()
    assert done.wait(10)
    t.join()
    for _ in range(2):
        server.servicer.ack_gate.release()
    w.flush(timeout_ms=10_000)
    assert len(server.servicer.items) == 3
    with pytest.raises(ValueError):
        w.flush(block_until_num_items=-1)
    w.close()


def test_end_episode_timeout_still_resets(server, client):
    server.servicer.ack_gate = threading.Semaphore(0)
    w = TrajectoryWriter(client, 8)
    w.append({"r": np.int64(1)})
    w.create_item("t", 1.0, w.history["r"][:])
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        w.end_episode(timeout_ms=200)
    assert time.monotonic() - start < 5
    assert w.episode_steps == 0 and len(w.history["r"]) == 0
    server.servicer.ack_gate.release()
    w.flush(timeout_ms=10_000)
    w.close()


def test_large_items_are_split_across_requests(server, client):
    # 3 steps of 2 MiB each: more than gRPC's default 4 MiB message limit in total.
    big = np.arange(3 * (1 << 19), dtype=np.float32).reshape(3, 1 << 19)
    w = TrajectoryWriter(client, 4)
    for row in big:
        w.append({"x": row})
    w.create_item("t", 1.0, w.history["x"][:])
    w.flush(timeout_ms=30_000)
    np.testing.assert_array_equal(server.servicer.items[0].data, big)
    assert all(r.ByteSize() < (4 << 20) for r in server.servicer.requests)
    w.close()


def test_configure_changes_a_columns_keep_alive_window(client):
    w = TrajectoryWriter(client, 2)
    with pytest.raises(ValueError):
        w.configure(("a",), num_keep_alive_refs=0, max_chunk_length=None)
    with pytest.raises(ValueError):
        w.configure(("a",), num_keep_alive_refs=2, max_chunk_length=3)
    with pytest.raises(TypeError):
        w.configure("a", num_keep_alive_refs=2, max_chunk_length=None)
    w.configure(("a",), num_keep_alive_refs=6, max_chunk_length=2)
    for i in range(6):
        w.append({"a": np.int64(i), "b": np.int64(i)})
    np.testing.assert_array_equal(w.history["a"][:].numpy(), np.arange(6))
    with pytest.raises(ValueError, match="None"):
        w.history["b"][:]
    w.close()


def test_configured_chunk_length_limits_chunks(server, client):
    w = TrajectoryWriter(client, 8)
    w.configure(("a",), num_keep_alive_refs=8, max_chunk_length=2)
    for i in range(5):
        w.append({"a": np.int64(i)})
    w.create_item("t", 1.0, w.history["a"][:])
    w.flush()
    assert [c.data.shape[0] for c in server.servicer.chunk_messages()] == [2, 2, 1]
    np.testing.assert_array_equal(server.servicer.items[0].data, np.arange(5))
    w.close()


def test_history_before_append_and_bad_arguments(client):
    with pytest.raises(ValueError):
        TrajectoryWriter(client, 0)
    w = TrajectoryWriter(client, 3)
    with pytest.raises(RuntimeError):
        w.history  # noqa: B018
    with pytest.raises(ValueError, match="object"):
        w.append({"s": {"x": object()}})
    w.close()


def test_buffer_compaction_keeps_the_window(server, client):
    # Many more steps than the buffer holds: rows move to the front now and then.
    w = TrajectoryWriter(client, 3)
    n = 6000
    for i in range(n):
        w.append({"r": np.int64(i)})
        if i % 997 == 0 and i >= 2:
            w.create_item("t", 1.0, w.history["r"][-3:])
    w.flush()
    for item in server.servicer.items:
        assert list(item.data) == list(range(int(item.data[0]), int(item.data[0]) + 3))
    np.testing.assert_array_equal(w.history["r"][-3:].numpy(), [n - 3, n - 2, n - 1])
    w.close()


def test_a_large_window_grows_as_rows_come_and_keeps_them(server, client):
    """A window larger than the first buffer: the buffer doubles as rows come and every row stays referable."""
    w = TrajectoryWriter(client, 50000)
    n = 30000
    for i in range(n):
        w.append({"r": np.int64(i)})
        if i % 4999 == 0 and i:
            w.create_item("t", 1.0, w.history["r"][-4999:])
    column = w._columns[0]
    assert 2 * n > column.cap >= n  # grown by doubling, not to the whole window (100,000 rows)
    w.create_item("t", 1.0, w.history["r"][:])
    w.flush()
    *windows, whole = [item.data for item in server.servicer.items]
    for data in windows:
        np.testing.assert_array_equal(data, np.arange(int(data[0]), int(data[0]) + 4999))
    np.testing.assert_array_equal(whole, np.arange(n))
    w.close()


def test_context_manager_flushes_and_closes(server, client):
    server.servicer.ack_gate = threading.Semaphore(0)
    w = TrajectoryWriter(client, 3)
    w.append({"r": np.int64(1)})
    w.create_item("t", 1.0, w.history["r"][:])
    released = threading.Timer(0.3, server.servicer.ack_gate.release)
    released.start()
    with w:
        pass
    assert len(server.servicer.items) == 1  # flushed: acknowledged before __exit__ returned
    released.join()


def test_dropped_writer_ends_its_stream(server, client):
    w = TrajectoryWriter(client, 3)
    w.append({"r": np.int64(1)})
    w.create_item("t", 1.0, w.history["r"][:])
    w.flush()
    del w
    deadline = time.monotonic() + 10
    while server.servicer.streams_ended < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.servicer.streams_ended == 1


def test_a_stream_is_cancelled_once_however_often_it_is_aborted(server, client):
    """The finalizer at exit and __del__ both abort a dropped writer's stream: gRPC is called once (not at exit)."""
    w = TrajectoryWriter(client, 3)
    w.append({"r": np.int64(1)})
    w.create_item("t", 1.0, w.history["r"][:])
    w.flush()
    stream = w._stream
    cancels = []
    cancel = stream._call.cancel
    stream._call.cancel = lambda: cancels.append(1) or cancel()
    w._finalizer()  # what runs at exit
    w.close(_wait=False)  # what __del__ does later
    assert cancels == [1] and w._stream is None


def test_clients_without_a_channel_use_the_stub(server, client):
    class StubOnly:
        def __init__(self, inner):
            self._stub = inner._stub
            self._table_info = inner._table_info

    w = TrajectoryWriter(StubOnly(client), 4)
    for i in range(3):
        w.append({"obs": obs(i)})
    w.create_item("t", 1.0, {"obs": w.history["obs"][:]})
    w.flush()
    np.testing.assert_array_equal(server.servicer.items[0].data["obs"], np.stack([obs(i) for i in range(3)]))
    w.close()


def test_batched_items_survive_buffer_compaction(server, client, monkeypatch):
    """Items batched while gRPC is busy reference rows a compaction moves: they are sent first."""
    from gear_client.writers import insert_stream

    # gRPC's request thread never takes the batch itself: it goes out when full, before a compaction, or on flush.
    monkeypatch.setattr(insert_stream.InsertStream, "_take_batch", lambda self, requests: None)
    w = TrajectoryWriter(client, 2)
    expected = []
    for i in range(10000):  # the 2-row window's buffers (4098 rows) take turns twice
        w.append({"r": np.int64(i)})
        if i % 100 == 1:
            w.create_item("t", 1.0, w.history["r"][-2:])
            expected.append([i - 1, i])
    w.flush()
    assert [list(item.data) for item in server.servicer.items] == expected
    # Two messages: the batch sent before the second compaction overwrote the first buffer, and the rest.
    assert len(server.servicer.requests) == 2
    w.close()


def test_a_server_that_never_comes_back_fails_the_items_with_their_keys(client):
    from gear_client.errors import ItemsNotInsertedError

    srv = LoopbackServer()
    c = FakeClient(srv.address, {"t": pb.TableInfo(name="t")})
    srv.servicer.ack_gate = threading.Semaphore(0)  # the item stays unacknowledged
    w = TrajectoryWriter(c, 4, reconnect_timeout_s=0.5)
    w.append({"r": np.int64(1)})
    w.create_item("t", 1.0, w.history["r"][:])
    deadline = time.monotonic() + 10
    while not srv.servicer.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    key = srv.servicer.requests[0].items[0].key
    srv.stop()
    started = time.monotonic()
    with pytest.raises(ItemsNotInsertedError, match="1 items were not inserted.*unreachable for 0.5 s") as info:
        w.flush(timeout_ms=10_000)
    assert time.monotonic() - started < 5
    assert isinstance(info.value, RuntimeError)  # what Reverb raises for an unavailable server
    assert info.value.keys == (key,)
    assert srv.servicer.items == []  # the cut-off stream left no item behind
    w.flush(timeout_ms=1000)  # nothing pending: no error
    w.close()
    c.close()


def test_negative_priority_is_refused_before_sending(server, client):
    w = TrajectoryWriter(client, 2)
    w.append({"r": np.int64(1)})
    with pytest.raises(ValueError, match="negative"):
        w.create_item("t", -1.0, w.history["r"][:])
    w.flush()
    assert server.servicer.requests == []
    w.close()


def test_episode_bookkeeping_stays_bounded(client):
    w = TrajectoryWriter(client, 3)
    for episode in range(50):
        w.append({"r": np.int64(episode)})
        w.end_episode(clear_buffers=False)
    column = w.history["r"]._column
    assert len(column.episode_marks) <= 4  # only episodes whose rows are still within the window
    np.testing.assert_array_equal(w.history["r"][-3:].numpy(), [47, 48, 49])
    w.close()


@pytest.mark.parametrize("dtype", [np.complex128, np.float16, np.bool_, ">f4", "S5", "U3", "M8[ns]", np.uint64])
def test_every_fixed_size_dtype_travels_raw(server, client, dtype):
    values = np.arange(6).reshape(3, 2).astype(dtype)
    w = TrajectoryWriter(client, 3)
    for row in values:
        w.append({"x": row})
    w.create_item("t", 1.0, w.history["x"][:])
    w.flush()
    (chunk,) = server.servicer.chunk_messages()
    assert chunk.data.dtype == values.dtype.str and list(chunk.data.shape) == [3, 2]
    np.testing.assert_array_equal(server.servicer.items[0].data, values)
    w.close()


@pytest.mark.parametrize("layout", ["contiguous", "strided", "fortran", "read_only", "big_endian"])
def test_large_rows_of_any_memory_layout_are_stored_exactly(server, client, layout):
    # Rows (4 KiB) stored from views of any layout, by the fast path and by the
    # partial-step path, read back exactly after many buffer compactions.
    def row(i: int) -> np.ndarray:
        base = (np.arange(256, dtype=np.float64) + 1000 * i).astype(">f4" if layout == "big_endian" else np.float32)
        if layout == "strided":
            return np.repeat(base, 2)[::2].reshape(16, 16)
        if layout == "fortran":
            return np.asfortranarray(base.reshape(16, 16))
        if layout == "read_only":
            base.setflags(write=False)
        return base.reshape(16, 16)

    w = TrajectoryWriter(client, 4)
    expected = []
    for i in range(1500):  # far more rows than one buffer holds (1 MiB of spare rows / 1 KiB)
        x = row(i)
        expected.append(np.array(x))
        w.append({"x": x, "r": np.int64(i)})
        if i % 300 == 299:
            w.append({"x": row(-i)}, partial_step=True)  # the slow path stores a row too
            expected.append(np.array(row(-i)))
            w.append({"r": np.int64(-i)})
            w.create_item("t", 1.0, {"x": w.history["x"][-4:], "r": w.history["r"][-4:]})
    w.flush()
    items = server.servicer.items
    assert len(items) == 5
    for n, item in enumerate(items):
        end = 300 * (n + 1) + n + 1
        np.testing.assert_array_equal(item.data["x"], np.stack(expected[end - 4:end]))
    x_chunks = [c for c in server.servicer.chunk_messages() if list(c.data.shape)[1:] == [16, 16]]
    assert x_chunks and all(c.data.dtype == expected[0].dtype.str for c in x_chunks)
    np.testing.assert_array_equal(w.history["x"][-1].numpy(), expected[-1])
    w.close()


def test_opening_the_stream_keeps_large_buffers_in_the_heap(server, client, monkeypatch):
    # Each message is a fresh multi-MiB bytes object; the writer tunes glibc once so they reuse heap pages.
    calls = []
    monkeypatch.setattr("gear_client.writers.insert_stream.tune_allocator", lambda: calls.append(1) or True)
    with TrajectoryWriter(client, 1) as w:
        assert calls == []  # nothing before the stream opens
        w.append({"r": np.int64(1)})
        w.create_item("t", 1.0, w.history["r"][-1:])
        w.create_item("t", 1.0, w.history["r"][-1:])
    assert calls == [1]  # once per stream
    assert len(server.servicer.items) == 2


def test_history_slices_reaching_before_the_first_step_raise(server, client):
    # Reverb pads the steps before the first with None references, which a TrajectoryColumn refuses.
    w = TrajectoryWriter(client, 8)
    w.append({"x": np.int64(1)})
    w.append({"x": np.int64(2)})
    with pytest.raises(ValueError, match="None data references"):
        w.history["x"][-3:]
    with pytest.raises(ValueError, match="None data references"):
        w.history["x"][-5:-3]
    assert len(w.history["x"][-2:]) == 2 and w.history["x"][-2:].numpy().tolist() == [1, 2]
    assert w.history["x"][0:9].numpy().tolist() == [1, 2]  # a stop past the end is clipped (as a list slice)
    w.close()
