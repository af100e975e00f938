"""The ReplayService over raw gRPC: a real daemon on loopback, real shared memory.

Every RPC is called through the generated stub (or raw bytes), bad input gets
its status and leaves the tables as they were, and the daemon keeps serving.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import grpc
import numpy as np
import pytest

from gear_contract import rate_limiters, selectors
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.channel import CHANNEL_OPTIONS
from gear_contract.wire import decode_sample_response
from gear_server.daemon import Daemon

LEAF = pb.Structure(kind=pb.Structure.LEAF)
PROMPT_S = 10.0


def table_config(name, sampler=None, remover=None, max_size=100, limiter=None, signature=None,
                 max_times_sampled=0):
    config = pb.TableConfig(name=name, sampler=(sampler or selectors.Uniform()).to_proto(),
                            remover=(remover or selectors.Fifo()).to_proto(), max_size=max_size,
                            rate_limiter=(limiter or rate_limiters.MinSize(1)).to_proto(),
                            max_times_sampled=max_times_sampled)
    if signature is not None:
        config.signature.CopyFrom(signature)
    return config


def tensor(a: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes())


def chunk(key: int, a: np.ndarray, episode: int = 1, step: int = 0) -> pb.ChunkData:
    return pb.ChunkData(chunk_key=key, data=tensor(a), episode_id=episode, episode_step=step)


def item(key: int, table: str, slices: list[tuple[int, int, int]], priority: float = 1.0,
         structure: pb.Structure = LEAF, squeeze: bool = False) -> pb.PrioritizedItem:
    """An item of one column made of (chunk_key, offset, length) slices."""
    column = pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=k, offset=o, length=n) for k, o, n in slices],
                           squeeze=squeeze)
    return pb.PrioritizedItem(key=key, table=table, priority=priority, structure=structure, columns=[column])


def simple_insert(key: int, table: str, data: np.ndarray, priority: float = 1.0) -> pb.InsertStreamRequest:
    """One chunk holding ``data`` ([T, ...]) and one item over all of it."""
    return pb.InsertStreamRequest(chunks=[chunk(key, data)], items=[item(key, table, [(key, 0, len(data))], priority)],
                                  release_chunk_keys=[key])


SIGNATURE = pb.Signature(structure=LEAF, leaves=[pb.TensorSpec(name="x", dtype="<f4", shape=[-1, 3])])


@pytest.fixture(scope="module")
def daemon():
    shm_dir = f"/dev/shm/gear-test-{uuid.uuid4().hex[:10]}"
    os.makedirs(shm_dir)
    config = pb.ServerConfig(bind_address="127.0.0.1", port=0, shm_dir=shm_dir, instance_name="svc", tables=[
        table_config("uniform"),
        table_config("signed", signature=SIGNATURE),
        table_config("queue", selectors.Fifo(), selectors.Fifo(), max_size=10, limiter=rate_limiters.Queue(2),
                     max_times_sampled=1),
        table_config("prio", selectors.Prioritized(1.0)),
    ])
    d = Daemon(config)
    d.start()
    yield d
    d.stop()
    shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def channel(daemon):
    ch = grpc.insecure_channel(f"127.0.0.1:{daemon.port}", options=CHANNEL_OPTIONS)
    yield ch
    ch.close()


@pytest.fixture
def stub(channel, daemon):
    s = pb_grpc.ReplayServiceStub(channel)
    for name in daemon.tables:
        s.Reset(pb.ResetRequest(table=name), timeout=PROMPT_S)
    return s


def insert(stub, *requests) -> list[int]:
    return [k for r in stub.InsertStream(iter(requests), timeout=PROMPT_S) for k in r.keys]


def size(stub, table: str) -> int:
    infos = stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S).table_info
    return next(t.current_size for t in infos if t.name == table)


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        result = fn(*args, **kwargs)
        if not isinstance(result, (pb.ServerInfoResponse, pb.ResetResponse, pb.MutatePrioritiesResponse)):
            list(result)
    return e.value


# ------------------------------------------------------------------ happy paths

def test_item_spanning_two_chunks_samples_back_byte_for_byte(stub):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.arange(12, 18, dtype=np.float32).reshape(2, 3)
    request = pb.InsertStreamRequest(chunks=[chunk(1, a), chunk(2, b, step=4)],
                                     items=[item(77, "uniform", [(1, 1, 3), (2, 0, 2)], priority=2.5)])
    assert insert(stub, request) == [77]
    responses = list(stub.Sample(pb.SampleRequest(table="uniform", num_samples=1), timeout=PROMPT_S))
    assert len(responses) == 1
    batch = responses[0].batch
    assert [i.key for i in batch.info] == [77]
    assert batch.info[0].priority == 2.5 and batch.info[0].table_size == 1 and batch.info[0].times_sampled == 1
    assert list(batch.lengths) == [5]
    column = batch.columns[0]
    got = np.frombuffer(column.data, np.dtype(column.dtype)).reshape(tuple(column.shape))
    np.testing.assert_array_equal(got, np.concatenate([a[1:4], b]))
    assert batch.structure == LEAF and list(batch.squeeze) == [False]


def test_sample_packs_several_items_per_message_and_both_decoders_agree(stub, channel):
    for k in range(10):
        insert(stub, simple_insert(100 + k, "uniform", np.full((2, 3), k, np.float32)))
    sizes = [len(r.batch.info) for r in stub.Sample(
        pb.SampleRequest(table="uniform", num_samples=10, max_items_per_message=4), timeout=PROMPT_S)]
    assert sizes == [4, 4, 2]
    # Small items go many to a message by default.
    assert len(list(stub.Sample(pb.SampleRequest(table="uniform", num_samples=10), timeout=PROMPT_S))) == 1

    raw_call = channel.unary_stream("/gear.v1.ReplayService/Sample",
                                    request_serializer=pb.SampleRequest.SerializeToString,
                                    response_deserializer=None)
    for raw in raw_call(pb.SampleRequest(table="uniform", num_samples=6, max_items_per_message=3), timeout=PROMPT_S):
        fast = decode_sample_response(raw)
        slow = pb.SampleResponse.FromString(raw).batch
        assert [i.key for i in fast.infos] == [i.key for i in slow.info]
        column = np.frombuffer(slow.columns[0].data, np.float32).reshape(tuple(slow.columns[0].shape))
        np.testing.assert_array_equal(fast.columns[0], column)
        for i in range(fast.num_items):
            (leaf,) = fast.item_columns(i)
            assert leaf.shape == (2, 3) and np.all(leaf == (int(fast.infos[i].key) - 100))


def test_mutate_priorities_reset_server_info_and_rate_limiter_check(stub, daemon):
    assert stub.CheckRateLimiter(pb.RateLimiterCheckRequest(table="prio", num_samples=1),
                                 timeout=PROMPT_S).can_sample is False
    insert(stub, simple_insert(1, "prio", np.zeros((1, 3), np.float32), priority=1.0),
           simple_insert(2, "prio", np.ones((1, 3), np.float32), priority=1.0))
    check = stub.CheckRateLimiter(pb.RateLimiterCheckRequest(table="prio", num_samples=1, num_inserts=1),
                                  timeout=PROMPT_S)
    assert check.can_sample and check.can_insert

    stub.MutatePriorities(pb.MutatePrioritiesRequest(table="prio", updates=[pb.KeyWithPriority(key=1, priority=0.0)],
                                                     delete_keys=[12345]), timeout=PROMPT_S)
    keys = {i.key for r in stub.Sample(pb.SampleRequest(table="prio", num_samples=20), timeout=PROMPT_S)
            for i in r.batch.info}
    assert keys == {2}  # priority 0: never sampled
    stub.MutatePriorities(pb.MutatePrioritiesRequest(table="prio", delete_keys=[2]), timeout=PROMPT_S)
    assert size(stub, "prio") == 1

    response = stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S)
    assert {t.name for t in response.table_info} == {"uniform", "signed", "queue", "prio"}
    assert response.version and response.host_id == daemon.host_id
    stub.Reset(pb.ResetRequest(table="prio"), timeout=PROMPT_S)
    info = next(t for t in stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S).table_info if t.name == "prio")
    assert info.current_size == 0 and info.rate_limiter_info.num_deletes == 0


def test_checkpoint_without_a_directory_is_unimplemented(stub):
    assert rpc_error(stub.Checkpoint, pb.CheckpointRequest(), timeout=PROMPT_S).code() == \
        grpc.StatusCode.UNIMPLEMENTED


# ------------------------------------------------------------------ bad input

def test_unknown_table_is_not_found_for_every_rpc(stub):
    cases = [
        (stub.Sample, pb.SampleRequest(table="nope", num_samples=1)),
        (stub.MutatePriorities, pb.MutatePrioritiesRequest(table="nope")),
        (stub.Reset, pb.ResetRequest(table="nope")),
        (stub.CheckRateLimiter, pb.RateLimiterCheckRequest(table="nope", num_samples=1)),
    ]
    for fn, request in cases:
        error = rpc_error(fn, request, timeout=PROMPT_S)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.details()
    error = rpc_error(stub.InsertStream, iter([simple_insert(5, "nope", np.zeros((1, 3), np.float32))]),
                      timeout=PROMPT_S)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.details()


def _bad_requests():
    x = np.zeros((2, 3), np.float32)
    good_chunk = chunk(1, x)
    yield "bad dtype string", pb.InsertStreamRequest(
        chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="not-a-dtype", shape=[2, 3], data=x.tobytes()))],
        items=[item(9, "uniform", [(1, 0, 2)])]), "dtype"
    yield "object dtype", pb.InsertStreamRequest(
        chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="|O", shape=[1], data=b"\0" * 8))]), "dtype"
    yield "size not matching shape", pb.InsertStreamRequest(
        chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="<f4", shape=[2, 3], data=b"\0" * 20))],
        items=[item(9, "uniform", [(1, 0, 2)])]), "bytes"
    yield "chunk of more than 64 dimensions", pb.InsertStreamRequest(
        chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="<f4", shape=[1] * 65, data=b"\0" * 4))],
        items=[item(9, "uniform", [(1, 0, 1)])]), "rank 65"
    yield "chunk without a time dimension", pb.InsertStreamRequest(
        chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="<f4", shape=[], data=b"\0" * 4))]), "rank"
    yield "unknown chunk", pb.InsertStreamRequest(chunks=[good_chunk], items=[item(9, "uniform", [(2, 0, 2)])]), \
        "unknown chunk"
    yield "slice outside the chunk", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[item(9, "uniform", [(1, 1, 5)])]), "outside"
    yield "NaN priority", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[item(9, "uniform", [(1, 0, 2)], priority=float("nan"))]), "NaN"
    yield "negative priority", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[item(9, "uniform", [(1, 0, 2)], priority=-1.0)]), "negative"
    yield "empty trajectory", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[pb.PrioritizedItem(key=9, table="uniform", priority=1.0, structure=LEAF)]), \
        "empty trajectory"
    yield "structure and columns disagree", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[item(9, "uniform", [(1, 0, 2)], structure=pb.Structure(
            kind=pb.Structure.DICT, keys=["a", "b"], children=[LEAF, LEAF]))]), "leaves"
    yield "malformed structure", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[item(9, "uniform", [(1, 0, 2)], structure=pb.Structure(
            kind=pb.Structure.DICT, keys=["a", "b"], children=[LEAF]))]), "keys"
    yield "squeezed column over two steps", pb.InsertStreamRequest(
        chunks=[good_chunk], items=[item(9, "uniform", [(1, 0, 2)], squeeze=True)]), "squeezed"
    yield "dtype against the signature", pb.InsertStreamRequest(
        chunks=[chunk(1, np.zeros((2, 3), np.float64))], items=[item(9, "signed", [(1, 0, 2)])]), "dtype"
    yield "shape against the signature", pb.InsertStreamRequest(
        chunks=[chunk(1, np.zeros((2, 4), np.float32))], items=[item(9, "signed", [(1, 0, 2)])]), "shape"


@pytest.mark.parametrize("name,request_,words", list(_bad_requests()), ids=[c[0] for c in _bad_requests()])
def test_invalid_insert_is_refused_and_changes_nothing(stub, name, request_, words):
    table = request_.items[0].table if request_.items else "uniform"
    insert(stub, simple_insert(50, table, np.ones((2, 3), np.float32)))
    error = rpc_error(stub.InsertStream, iter([request_]), timeout=PROMPT_S)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    assert words.lower() in error.details().lower(), error.details()
    assert size(stub, table) == 1
    # The daemon keeps serving: the same table takes a valid item and gives back the old one intact.
    assert insert(stub, simple_insert(51, table, np.full((2, 3), 5, np.float32))) == [51]
    got = {r.batch.info[0].key: r for r in stub.Sample(
        pb.SampleRequest(table=table, num_samples=30, max_items_per_message=1), timeout=PROMPT_S)}
    assert set(got) == {50, 51}
    col = got[50].batch.columns[0]
    np.testing.assert_array_equal(np.frombuffer(col.data, np.float32), np.ones(6, np.float32))


def test_bytes_that_are_no_request_are_invalid_argument(channel, stub):
    for method, kind in (("InsertStream", "stream_stream"), ("Sample", "unary_stream"),
                         ("ServerInfo", "unary_unary"), ("MutatePriorities", "unary_unary")):
        call = getattr(channel, kind)(f"/gear.v1.ReplayService/{method}", request_serializer=None,
                                      response_deserializer=None)
        garbage = b"\xff\xff\xff\xff\x0f"
        with pytest.raises(grpc.RpcError) as e:
            result = call(iter([garbage]) if kind == "stream_stream" else garbage, timeout=PROMPT_S)
            if kind != "unary_unary":
                list(result)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "not a valid request" in e.value.details()
    assert size(stub, "uniform") == 0


def test_bad_sample_and_mutate_arguments(stub):
    insert(stub, simple_insert(7, "uniform", np.zeros((1, 3), np.float32), priority=3.0))
    for request in (pb.SampleRequest(table="uniform", num_samples=0),
                    pb.SampleRequest(table="uniform", num_samples=1, max_items_per_message=-1),
                    pb.SampleRequest(table="uniform", num_samples=1, max_items_per_message=2**31 - 1),
                    pb.SampleRequest(table="uniform", num_samples=1, max_items_per_message=(1 << 20) + 1)):
        assert rpc_error(stub.Sample, request, timeout=PROMPT_S).code() == grpc.StatusCode.INVALID_ARGUMENT
    for priority in (float("nan"), -0.5):
        error = rpc_error(stub.MutatePriorities, pb.MutatePrioritiesRequest(
            table="uniform", updates=[pb.KeyWithPriority(key=7, priority=priority)], delete_keys=[7]),
            timeout=PROMPT_S)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in error.details()
    (response,) = stub.Sample(pb.SampleRequest(table="uniform", num_samples=1), timeout=PROMPT_S)
    assert response.batch.info[0].key == 7 and response.batch.info[0].priority == 3.0  # neither deleted nor changed


def test_stream_cut_off_mid_episode_leaves_only_whole_items(stub):
    hold = threading.Event()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)

    def requests():
        yield pb.InsertStreamRequest(chunks=[chunk(1, x)], items=[item(31, "uniform", [(1, 0, 2)])])
        yield pb.InsertStreamRequest(chunks=[chunk(2, x + 10, step=2)])  # the episode goes on, no item yet
        hold.wait(PROMPT_S)

    call = stub.InsertStream(requests(), timeout=PROMPT_S)
    assert list(next(call).keys) == [31]
    call.cancel()
    hold.set()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    time.sleep(0.2)
    infos = list(stub.Sample(pb.SampleRequest(table="uniform", num_samples=5), timeout=PROMPT_S))
    assert {i.key for r in infos for i in r.batch.info} == {31}
    assert size(stub, "uniform") == 1


# ------------------------------------------------------------------ blocking

def test_inserts_wait_for_the_rate_limiter_and_acks_come_after(stub):
    """Queue(2): a third insert is acknowledged only once a sample made room (back-pressure)."""
    acks: list[tuple[int, float]] = []
    requests = [simple_insert(60 + k, "queue", np.full((1, 3), k, np.float32)) for k in range(3)]

    def run():
        for response in stub.InsertStream(iter(requests), timeout=PROMPT_S):
            acks.extend((k, time.monotonic()) for k in response.keys)

    writer = threading.Thread(target=run)
    writer.start()
    deadline = time.monotonic() + PROMPT_S
    while len(acks) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.4)
    assert [k for k, _ in acks] == [60, 61], "the third insert went past the rate limiter"
    sampled_at = time.monotonic()
    (response,) = stub.Sample(pb.SampleRequest(table="queue", num_samples=1), timeout=PROMPT_S)
    assert response.batch.info[0].key == 60  # fifo
    writer.join(PROMPT_S)
    assert [k for k, _ in acks] == [60, 61, 62] and acks[2][1] >= sampled_at


def _sample_stats(stub, table: str) -> pb.RateLimiterCallStats:
    infos = stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S).table_info
    return next(t for t in infos if t.name == table).rate_limiter_info.sample_stats


def test_sample_deadline_and_a_cancelled_blocked_sample_takes_nothing(stub):
    before = _sample_stats(stub, "queue")
    started = time.monotonic()
    error = rpc_error(stub.Sample, pb.SampleRequest(table="queue", num_samples=1, timeout_ms=200), timeout=PROMPT_S)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 5

    call = stub.Sample(pb.SampleRequest(table="queue", num_samples=1), timeout=PROMPT_S)
    time.sleep(0.3)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    time.sleep(0.2)
    insert(stub, simple_insert(70, "queue", np.zeros((1, 3), np.float32)))
    time.sleep(0.3)  # a sampler that survived its cancellation would take the item now
    assert size(stub, "queue") == 1
    # Neither call sampled anything (completed is the sample counter, as in Reverb 0.14); the
    # timed-out wait counts as limited, the cancelled one is forgotten.
    after = _sample_stats(stub, "queue")
    assert after.completed == before.completed and after.limited == before.limited + 1


def test_stopping_the_daemon_ends_blocked_calls_and_unlinks_its_segments():
    shm_dir = f"/dev/shm/gear-test-{uuid.uuid4().hex[:10]}"
    os.makedirs(shm_dir)
    try:
        config = pb.ServerConfig(bind_address="127.0.0.1", port=0, shm_dir=shm_dir, instance_name="stop",
                                 tables=[table_config("q", limiter=rate_limiters.MinSize(5))])
        daemon = Daemon(config)
        port = daemon.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.ReplayServiceStub(ch)
            insert(stub, simple_insert(1, "q", np.zeros((1, 3), np.float32)))
            assert len(os.listdir(shm_dir)) == 1
            call = stub.Sample(pb.SampleRequest(table="q", num_samples=1), timeout=PROMPT_S)
            time.sleep(0.2)
            started = time.monotonic()
            daemon.stop()
            assert time.monotonic() - started < 5
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert os.listdir(shm_dir) == []
        assert daemon.wait(0)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_daemon_that_cannot_bind_leaves_no_thread_or_segment():
    import socket

    shm_dir = f"/dev/shm/gear-test-{uuid.uuid4().hex[:10]}"
    os.makedirs(shm_dir)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            config = pb.ServerConfig(bind_address="127.0.0.1", port=taken.getsockname()[1], shm_dir=shm_dir,
                                     instance_name="nobind", tables=[table_config("t")])
            daemon = Daemon(config)
            with pytest.raises(OSError, match="cannot bind"):
                daemon.start()
        assert daemon.wait(0) and os.listdir(shm_dir) == []
        assert daemon.tables and all(table.closed for table in daemon.tables.values())
        planes = daemon.service.data_planes
        assert planes is None or not planes._reaper.is_alive()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def test_out_of_shared_memory_is_resource_exhausted_and_the_daemon_serves_on(stub, daemon, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(daemon.store, "create", full)
    odd = np.arange(10, dtype=np.int16).reshape(2, 5)  # a layout no table has: needs a new segment
    e = rpc_error(insert, stub, simple_insert(1, "uniform", odd))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "No space left" in e.details()
    assert size(stub, "uniform") == 0
    monkeypatch.undo()
    assert insert(stub, simple_insert(1, "uniform", odd)) == [1]


def test_a_table_error_while_encoding_a_sample_maps_to_its_status_and_releases_the_lease(stub, daemon,
                                                                                          monkeypatch):
    from gear_server.errors import TableClosedError

    table = daemon.tables["uniform"]
    insert(stub, simple_insert(1, "uniform", np.zeros((2, 3), np.float32)))

    def closed(selection):
        raise TableClosedError("table 'uniform' is closed")

    monkeypatch.setattr(table, "item_groups", closed)
    e = rpc_error(stub.Sample, pb.SampleRequest(table="uniform", num_samples=1), timeout=PROMPT_S)
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "closed" in e.details()
    assert table.active_leases() == 0


def test_a_flood_of_bad_requests_gets_a_few_log_lines_and_no_traceback(stub, caplog):
    import logging

    too_deep = pb.InsertStreamRequest(chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(
        dtype="<f4", shape=[1] * 65, data=b"\0" * 4))], items=[item(9, "uniform", [(1, 0, 1)])])
    with caplog.at_level(logging.INFO, logger="gear_server"):
        for _ in range(50):
            error = rpc_error(stub.InsertStream, iter([too_deep]), timeout=PROMPT_S)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 65" in error.details()
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) <= 6 and not any(r.exc_info for r in caplog.records)  # not one line per call
    assert size(stub, "uniform") == 0
