"""MutatePriorities off gRPC: the hand-framed request and the local lane, against real daemons on loopback.

The wire pieces round-trip through protobuf's own encoder and parser; the lane
is found through ServerInfo (only by authenticated callers), used on the
daemon's host only, refuses what it must (wrong secret, no hello, oversized
frames, too many connections) and gives way to gRPC when the daemon goes.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import struct
import time
import uuid

import grpc
import numpy as np
import pytest

import gear_client
from gear_client.connection import channel as connection_module
from gear_client.connection.lane_client import LaneBroken, LaneStatusError, LocalLane, open_local_lane
from gear_contract import rate_limiters, selectors
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.lane_frames import (
    HEAD,
    HELLO,
    LANE_KEY,
    MUTATE_PRIORITIES,
    RELEASE,
    SELECT,
    VERSION,
    decode_priorities,
    encode_priorities,
    frame,
    hello,
    parse_advertisement,
)
from gear_contract.negotiation import local_host_id
from gear_contract.wire import (
    HAND_DECODE_MIN_UPDATE_BYTES,
    decode_mutate_priorities,
    decode_mutate_priorities_by_hand,
    decode_mutate_priorities_by_protobuf,
    encode_mutate_priorities,
    encode_priority_updates,
)
from gear_server.config import DaemonSettings
from gear_server.daemon import Daemon
from gear_server.ops.auth import AuthSettings

EDGE_KEYS = [0, 1, 127, 128, 2**35 + 7, 2**63 - 1, 2**63, 2**64 - 1]


# ------------------------------------------------------------------ wire

def _proto(table: str, keys, priorities, deletes) -> pb.MutatePrioritiesRequest:
    return pb.MutatePrioritiesRequest(table=table, delete_keys=[int(k) for k in deletes], updates=[
        pb.KeyWithPriority(key=int(k), priority=float(p)) for k, p in zip(keys, priorities, strict=True)])


@pytest.mark.parametrize("n, deletes", [(0, 0), (1, 0), (8, 3), (64, 0), (256, 5), (0, 4)])
def test_hand_framed_request_is_the_protobuf_message(n, deletes):
    rng = np.random.default_rng(n)
    keys = np.array((EDGE_KEYS * (n // len(EDGE_KEYS) + 1))[:n], np.uint64)
    keys[len(EDGE_KEYS):] = rng.integers(0, 2**64 - 1, max(0, n - len(EDGE_KEYS)), np.uint64, endpoint=True)
    priorities = rng.uniform(0, 10, n)
    priorities[:min(n, 2)] = [0.0, -0.0][:min(n, 2)]
    dropped = np.array(EDGE_KEYS[:deletes], np.uint64)
    raw = encode_mutate_priorities("tábla", keys, priorities, dropped)
    expected = _proto("tábla", keys, priorities, dropped)
    assert pb.MutatePrioritiesRequest.FromString(raw) == expected
    for decoded in (decode_mutate_priorities_by_hand(raw), decode_mutate_priorities(raw),
                    decode_mutate_priorities(expected.SerializeToString())):
        assert decoded is not None
        assert decoded.table == "tábla"
        assert decoded.keys == keys.tolist() and decoded.deletes == dropped.tolist()
        assert np.array_equal(np.array(decoded.priorities), priorities)


def test_client_encoding_matches_protobuf_at_every_size():
    for n in (0, 1, 7, 8, 9, 300):
        updates = {k * 7919 + 2**62: k / 3 for k in range(n)}
        raw = encode_priority_updates("t", updates, [5, 2**64 - 1])
        assert pb.MutatePrioritiesRequest.FromString(raw) == _proto("t", updates, updates.values(), [5, 2**64 - 1])


def test_other_encodings_are_left_to_protobuf():
    # protobuf's own bytes: short varints, zero priorities left out, keys twice, unknown fields
    message = _proto("t", [3, 4, 3] * 60, [1.0, 0.0, 2.0] * 60, [9])
    raw = message.SerializeToString()
    assert len(raw) >= HAND_DECODE_MIN_UPDATE_BYTES
    assert decode_mutate_priorities_by_hand(raw) is None
    decoded = decode_mutate_priorities(raw)
    assert decoded.keys == [3, 4, 3] * 60 and decoded.priorities == [1.0, 0.0, 2.0] * 60 and decoded.deletes == [9]
    extra = raw + b"\xa0\x06\x01"  # field 100, varint: ignored by protobuf
    assert decode_mutate_priorities(extra) == decode_mutate_priorities_by_protobuf(raw)


@pytest.mark.parametrize("raw", [b"\x12", b"\x0a\x05ab", b"\xff" * 40, b"\x12\x14\x08" + b"\xff" * 19 * 100])
def test_bytes_that_are_no_request_raise_value_error(raw):
    with pytest.raises(ValueError, match="not a valid request message"):
        decode_mutate_priorities(raw)


@pytest.mark.parametrize("updates, deletes, message", [
    ({-1: 1.0}, None, "key -1 is not an integer"), ({"x": 1.0}, None, "key 'x'"),
    ({2**64: 1.0}, None, "key 18446744073709551616"), ({1: "high"}, None, "priority 'high' of key 1"),
    ({1: 1.0}, [-5], "delete key -5"), ({k: None for k in range(20)}, None, "priority None of key 0"),
])
def test_bad_arguments_name_the_entry(updates, deletes, message):
    with pytest.raises(ValueError, match=message):
        encode_priority_updates("t", updates, deletes)


def test_lane_request_round_trip_and_checks():
    priorities = np.linspace(0, 3, len(EDGE_KEYS)).tolist()
    for updates, deletes in ((dict(zip(EDGE_KEYS, priorities, strict=True)), [2**64 - 1, 5]),
                             ({np.uint64(k): np.float32(p) for k, p in zip(EDGE_KEYS, priorities, strict=True)},
                              np.array([2**64 - 1, 5], np.uint64)),
                             ({float(k): int(p) for k, p in zip(EDGE_KEYS[:5], priorities[:5], strict=True)}, (5.0,))):
        raw = encode_priorities("tábla", updates, deletes)
        decoded = decode_priorities(memoryview(raw))
        assert decoded.table == "tábla" and decoded.keys == [int(x) for x in updates]
        assert decoded.deletes == [2**64 - 1, 5][-len(decoded.deletes):]
        assert decoded.priorities.dtype == np.float64
        assert decoded.priorities.tolist() == [float(x) for x in updates.values()]
    for bad in (raw[:-1], raw + b"\0", raw[:5], b"\x02\x00\x00\x00\x00\x00\x00\x00\x00\x00\xff\xfe"):
        with pytest.raises(ValueError, match="not a valid request message"):
            decode_priorities(memoryview(bad))
    for updates, deletes, message in (({-1: 1.0}, None, "key -1"), ({1: "x"}, None, "priority 'x'"),
                                      ({1: 1.0}, [2**64], "delete key")):
        with pytest.raises(ValueError, match=message):
            encode_priorities("t", updates, deletes)


# ------------------------------------------------------------------ daemons

_SHM_DIRS: list[str] = []  # made by _config, removed after each test


@pytest.fixture(autouse=True)
def _remove_shm_dirs():
    yield
    while _SHM_DIRS:
        shutil.rmtree(_SHM_DIRS.pop(), ignore_errors=True)


def _config(port: int = 0) -> pb.ServerConfig:
    shm_dir = f"/dev/shm/gear-lane-{uuid.uuid4().hex[:10]}"
    os.makedirs(shm_dir)
    _SHM_DIRS.append(shm_dir)
    table = pb.TableConfig(name="prio", sampler=selectors.Prioritized(1.0).to_proto(),
                           remover=selectors.Fifo().to_proto(), max_size=1000,
                           rate_limiter=rate_limiters.MinSize(1).to_proto())
    return pb.ServerConfig(bind_address="127.0.0.1", port=port, shm_dir=shm_dir, instance_name="lane", tables=[table])


@pytest.fixture
def daemon():
    d = Daemon(_config())
    d.start()
    yield d
    d.stop()


def _fill(client: gear_client.Client, n: int = 40) -> list[int]:
    for i in range(n):
        client.insert({"x": np.full(3, i, np.float32)}, {"prio": 1.0})
    keys = set()
    while len(keys) < n:
        keys.update(s.info.key for s in client.sample("prio", 4 * n, emit_timesteps=False))
    return sorted(keys)


def _priorities(daemon: Daemon) -> dict[int, float]:
    table = daemon.tables["prio"]
    meta = table.meta
    valid = np.flatnonzero(meta.valid)
    return dict(zip(meta.key[valid].tolist(), meta.priority[valid].tolist(), strict=True))


def test_same_host_mutations_take_the_lane(daemon):
    client = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(client)
    updates = {k: float(i) for i, k in enumerate(keys)}
    client.mutate_priorities("prio", updates=updates, deletes=iter(keys[:3]))
    lane = client._daemon._lane
    assert lane is not None and daemon.service.local_lane.connections == 1
    assert _priorities(daemon) == {k: updates[k] for k in keys[3:]}
    # errors come back as the RPC's, and a refused call changes nothing
    before = _priorities(daemon)
    with pytest.raises(ValueError, match=f"key {keys[5]} is NaN"):
        client.mutate_priorities("prio", updates={keys[4]: 2.0, keys[5]: float("nan")})
    with pytest.raises(RuntimeError, match="'nope' not found"):
        client.mutate_priorities("nope", updates={keys[4]: 2.0})
    assert _priorities(daemon) == before and client._daemon._lane is lane
    ok = daemon.ops.metrics.rpcs.labels("MutatePriorities", "OK")._value
    seen = ok.get()
    client.mutate_priorities("prio", updates={keys[4]: 7.0})
    deadline = time.monotonic() + 5  # counted once the answer is out
    while ok.get() == seen and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ok.get() == seen + 1
    client.close()


def test_grpc_path_gives_the_same_answers(daemon, monkeypatch):
    monkeypatch.setenv("GEAR_LOCAL_LANE", "0")
    client = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(client)
    updates = {k: float(i) + 0.5 for i, k in enumerate(keys)}
    client.mutate_priorities("prio", updates=updates, deletes=keys[:2])
    assert client._daemon._lane is None and daemon.service.local_lane.connections == 0
    assert _priorities(daemon) == {k: updates[k] for k in keys[2:]}
    with pytest.raises(ValueError, match=f"key {keys[5]} is NaN"):
        client.mutate_priorities("prio", updates={keys[5]: float("nan")})
    with pytest.raises(RuntimeError, match="'nope' not found"):
        client.mutate_priorities("nope", updates={keys[4]: 2.0})
    # a key given twice in one request (protobuf's encoding): the last priority wins
    stub = pb_grpc.ReplayServiceStub(client._daemon.channel)
    stub.MutatePriorities(_proto("prio", [keys[6], keys[7], keys[6]], [1.0, 2.0, 3.0], []), timeout=10)
    assert _priorities(daemon)[keys[6]] == 3.0 and _priorities(daemon)[keys[7]] == 2.0
    client.close()


def test_lane_refuses_strangers(daemon):
    client = gear_client.Client(daemon.address(), data_planes=())
    lane = open_local_lane(client._daemon_channel().stub)
    assert isinstance(lane, LocalLane)
    address = "\0" + lane.name

    def answer(conn: socket.socket) -> tuple[int, bytes]:
        data = b""
        while len(data) < HEAD.size or len(data) < 4 + HEAD.unpack_from(data)[0]:
            more = conn.recv(4096)
            assert more, "the daemon closed without an answer"
            data += more
        return data[4], data[HEAD.size:]

    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(address)
        conn.sendall(frame(HELLO, b"\0" * 32))
        assert answer(conn)[0] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert conn.recv(10) == b""
    with socket.socket(socket.AF_UNIX) as conn:  # the right secret, another version
        conn.connect(address)
        conn.sendall(frame(HELLO, bytes((VERSION + 1,)) + lane._secret))
        code, message = answer(conn)
        assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and b"version" in message
    with socket.socket(socket.AF_UNIX) as conn:  # a call before the hello
        conn.connect(address)
        conn.sendall(frame(MUTATE_PRIORITIES, b""))
        assert answer(conn)[0] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    with socket.socket(socket.AF_UNIX) as conn:  # an oversized frame after the hello
        conn.connect(address)
        conn.sendall(hello(lane._secret))
        assert answer(conn)[0] == 0
        conn.sendall(struct.pack("<IB", 1 << 30, MUTATE_PRIORITIES))
        assert answer(conn)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    for request in (b"\xff" * 10, encode_priorities("prio", {1: 1.0, 2: 2.0}, [3, 4])[:-1]):
        with pytest.raises(LaneStatusError) as info:  # bytes that are no request
            lane.call(MUTATE_PRIORITIES, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid request message" in info.value.details()
    lane.close()
    client.close()


def test_strangers_cannot_hold_the_lane(daemon, monkeypatch):
    """Connections before their hello are capped apart and their whole hello has a deadline: a local
    process dribbling bytes or opening many sockets cannot keep the lane from the daemon's clients."""
    import gear_server.serving.lane_server as server_lane_module

    monkeypatch.setattr(server_lane_module, "HELLO_TIMEOUT_S", 1.0)
    client = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(client)
    lane = open_local_lane(client._daemon_channel().stub)
    address = "\0" + lane.name
    served = daemon.service.local_lane.connections  # the client's own (authenticated, idle)
    held = []
    for _ in range(server_lane_module.MAX_UNAUTHENTICATED + 2):  # never say hello
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(address)
        held.append(conn)
    time.sleep(0.2)
    assert daemon.service.local_lane.connections == served + server_lane_module.MAX_UNAUTHENTICATED
    slow = held[0]
    start = time.monotonic()
    try:  # one byte at a time, each well inside any per-read timeout: the hello's deadline still ends it
        while time.monotonic() - start < 5:
            slow.sendall(b"\x00")
            time.sleep(0.3)
    except OSError:
        pass
    assert time.monotonic() - start < 3
    deadline = time.monotonic() + 5
    while daemon.service.local_lane.connections > served and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.service.local_lane.connections == served  # every silent one ended at its deadline
    lane.call(MUTATE_PRIORITIES, encode_priorities("prio", {keys[0]: 5.0}, []))  # the lane serves again
    assert _priorities(daemon)[keys[0]] == 5.0
    for conn in held:
        conn.close()
    lane.close()
    client.close()


def test_full_lane_leaves_callers_on_grpc(daemon):
    server_lane = daemon.service.local_lane
    server_lane.max_connections = 1
    first = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(first)
    first.mutate_priorities("prio", updates={keys[0]: 2.0})
    assert first._daemon._lane is not None
    second = gear_client.Client(daemon.address(), data_planes=())
    second.mutate_priorities("prio", updates={keys[1]: 3.0})
    assert second._daemon._lane is None and server_lane.connections == 1
    assert _priorities(daemon)[keys[0]] == 2.0 and _priorities(daemon)[keys[1]] == 3.0
    first.close()
    second.close()


def test_daemon_on_another_host_is_called_over_grpc(daemon, monkeypatch):
    monkeypatch.setenv("GEAR_HOST_ID", "some-other-host")
    client = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(client)
    client.mutate_priorities("prio", updates={keys[0]: 4.0})
    assert client._daemon._lane is None and not client._daemon._lane_wanted
    assert _priorities(daemon)[keys[0]] == 4.0
    client.close()


def test_daemon_without_lane_is_called_over_grpc(monkeypatch):
    monkeypatch.setenv("GEAR_LOCAL_LANE", "0")
    d = Daemon(_config())
    d.start()
    try:
        assert d.service.local_lane is None
        monkeypatch.delenv("GEAR_LOCAL_LANE")
        client = gear_client.Client(d.address(), data_planes=())
        keys = _fill(client)
        client.mutate_priorities("prio", updates={keys[0]: 5.0})
        assert client._daemon._lane is None and _priorities(d)[keys[0]] == 5.0
        client.close()
    finally:
        d.stop()


def test_lane_is_for_authenticated_callers_only():
    settings = DaemonSettings.from_server_config(_config())
    settings.auth = AuthSettings(token="lane-test-token")
    d = Daemon(settings)
    d.start()
    try:
        with grpc.insecure_channel(d.address()) as channel:
            stub = pb_grpc.ReplayServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ServerInfo.with_call(pb.ServerInfoRequest(), metadata=((LANE_KEY, "1"),), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not any(key == LANE_KEY for key, _ in info.value.trailing_metadata() or ())
            _, call = stub.ServerInfo.with_call(pb.ServerInfoRequest(), timeout=10, metadata=(
                (LANE_KEY, "1"), ("authorization", "Bearer lane-test-token")))
            advertised = [parse_advertisement(v) for k, v in call.trailing_metadata() if k == LANE_KEY]
            assert advertised and advertised[0][0] == d.service.local_lane.name
            _, call = stub.ServerInfo.with_call(pb.ServerInfoRequest(), timeout=10,
                                                metadata=(("authorization", "Bearer lane-test-token"),))
            assert not any(key == LANE_KEY for key, _ in call.trailing_metadata())  # only when asked
        client = gear_client.Client(d.address(), data_planes=(), token="lane-test-token")
        keys = _fill(client)
        client.mutate_priorities("prio", updates={keys[0]: 6.0})
        assert client._daemon._lane is not None and _priorities(d)[keys[0]] == 6.0
        client.close()
    finally:
        d.stop()


def test_lane_closes_with_the_daemon_and_a_restart_brings_a_new_one(monkeypatch):
    monkeypatch.setattr(connection_module, "LANE_RETRY_S", 0.2)
    d = Daemon(_config())
    port = d.start()
    client = gear_client.Client(f"127.0.0.1:{port}", data_planes=(), connect_timeout=30)
    keys = _fill(client)
    client.mutate_priorities("prio", updates={keys[0]: 2.0})
    old = client._daemon._lane
    assert old is not None
    name = d.service.local_lane.name
    d.stop()
    with socket.socket(socket.AF_UNIX) as probe, pytest.raises(OSError):
        probe.connect("\0" + name)
    with pytest.raises(LaneBroken):
        old.call(MUTATE_PRIORITIES, encode_priorities("prio", {keys[0]: 1.0}, None))
    d2 = Daemon(_config(port))
    d2.start()
    try:
        client.mutate_priorities("prio", updates={1: 1.0})  # over gRPC: the old lane is gone
        assert client._daemon._lane is None
        keys = _fill(client)
        time.sleep(0.3)
        client.mutate_priorities("prio", updates={keys[0]: 9.0})
        assert client._daemon._lane is not None and client._daemon._lane.name == d2.service.local_lane.name
        assert _priorities(d2)[keys[0]] == 9.0
    finally:
        client.close()
        d2.stop()


def test_forked_child_opens_its_own_connection(daemon):
    client = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(client)
    client.mutate_priorities("prio", updates={keys[0]: 2.0})
    lane = client._daemon._lane
    parent_conn = lane._idle[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a lane call on a connection of its own, then report
        status = 1
        try:
            lane.call(MUTATE_PRIORITIES, encode_priorities("prio", {keys[1]: 8.0}, None))
            status = 0 if parent_conn not in lane._idle and len(lane._idle) == 1 else 2
        finally:
            os.write(write, bytes((status,)))
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"\0"
    os.waitpid(pid, 0)
    os.close(read)
    assert _priorities(daemon)[keys[1]] == 8.0
    client.mutate_priorities("prio", updates={keys[2]: 3.0})  # the parent's connection still answers in order
    assert _priorities(daemon)[keys[2]] == 3.0 and lane._idle == [parent_conn]
    client.close()


# ------------------------------------------------------------------ a learner's Select and Release

def _session(stub, table: str = "prio") -> str:
    offer = pb.DataPlaneOffer(shm=True, host_id=local_host_id())
    return stub.OpenDataPlane(pb.OpenDataPlaneRequest(table=table, offer=offer), timeout=10).session_id


def _select(session: str, n: int, release=(), timeout_ms: int = 0) -> bytes:
    return pb.SelectRequest(session_id=session, num_samples=n, packed=True, release_lease_ids=list(release),
                            timeout_ms=timeout_ms).SerializeToString()


def test_select_and_release_over_the_lane(daemon):
    client = gear_client.Client(daemon.address(), data_planes=())
    keys = _fill(client)
    stub = client._daemon_channel().stub
    lane = open_local_lane(stub)
    session = _session(stub)
    first = pb.SelectResponse.FromString(lane.call(SELECT, _select(session, 8)))
    assert len(np.frombuffer(first.keys.data, "<u8")) == 8 and set(np.frombuffer(first.keys.data, "<u8")) <= set(keys)
    # pipelined: two in flight, the second ends the first's lease; then a Release of the second's
    one = lane.future(SELECT, pb.SelectRequest.FromString(_select(session, 4)), pb.SelectResponse)
    two = lane.future(SELECT, pb.SelectRequest.FromString(_select(session, 4, [first.lease_id])), pb.SelectResponse)
    answers = [one.result(timeout=10), two.result(timeout=10)]
    assert one.done() and not two.cancel()
    assert len({first.lease_id, *(a.lease_id for a in answers)}) == 3 and not answers[1].stale_lease_ids
    released = pb.ReleaseResponse.FromString(lane.call(RELEASE, pb.ReleaseRequest(
        session_id=session, lease_ids=[answers[0].lease_id, first.lease_id]).SerializeToString()))
    assert list(released.stale_lease_ids) == [first.lease_id]  # ended already by the second Select
    leases = daemon.service.data_planes.sessions.get(session).leases
    assert set(leases) == {answers[1].lease_id}
    # errors as the RPC's
    for request, code in ((_select("no-such-session", 4), grpc.StatusCode.NOT_FOUND),
                          (_select(session, 0), grpc.StatusCode.INVALID_ARGUMENT),
                          (b"\xff\xff", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as info:
            lane.call(SELECT, request)
        assert info.value.code() == code
    lane.close()
    client.close()


def test_waiting_select_ends_with_its_caller_or_its_session():
    d = Daemon(_config())
    d.start()
    try:
        client = gear_client.Client(d.address(), data_planes=())
        stub = client._daemon_channel().stub
        lane = open_local_lane(stub)
        session = _session(stub)
        waiting = lane.submit(SELECT, _select(session, 2))  # an empty table: the rate limiter holds it
        with pytest.raises(grpc.FutureTimeoutError):
            waiting.result(timeout=0.2)
        assert not waiting.done() and waiting.cancel() and waiting.done()
        with pytest.raises(grpc.RpcError) as info:
            waiting.result()
        assert info.value.code() == grpc.StatusCode.CANCELLED
        deadline = time.monotonic() + 10
        while d.service.data_planes._selects and time.monotonic() < deadline:  # the daemon let it go
            time.sleep(0.01)
        assert not d.service.data_planes._selects
        keys = _fill(client, 4)
        assert not d.service.data_planes.sessions.get(session).leases  # the cancelled Select took none
        answer = pb.SelectResponse.FromString(lane.call(SELECT, _select(session, 4)))
        assert set(np.frombuffer(answer.keys.data, "<u8").tolist()) <= set(keys)
        assert list(d.service.data_planes.sessions.get(session).leases) == [answer.lease_id]
        empty = _session(stub, "prio")
        table = d.tables["prio"]
        table.reset()
        waiting = lane.submit(SELECT, _select(empty, 2))
        time.sleep(0.2)
        stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=empty), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            waiting.result(timeout=10)
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND)
        lane.close()
        client.close()
    finally:
        d.stop()


def test_lane_select_and_release_run_on_the_connection_thread(daemon, monkeypatch):
    """A lane Select (and Release) is answered on its connection's thread, table work inline: neither
    the daemon's event loop nor its table pool is asked, while the same call over gRPC uses them."""
    client = gear_client.Client(daemon.address(), data_planes=())
    _fill(client, 8)
    stub = client._daemon_channel().stub
    lane = open_local_lane(stub)
    session = _session(stub)
    pool_calls = []
    calls = daemon.service.data_planes.calls
    real_sample_batches, real_run = calls.sample_batches, calls.run

    async def counted_sample_batches(*args, **kwargs):
        pool_calls.append("sample_batches")
        return await real_sample_batches(*args, **kwargs)

    async def counted_run(*args):
        pool_calls.append("run")
        return await real_run(*args)

    monkeypatch.setattr(calls, "sample_batches", counted_sample_batches)
    monkeypatch.setattr(calls, "run", counted_run)
    answer = pb.SelectResponse.FromString(lane.call(SELECT, _select(session, 4)))
    released = pb.ReleaseResponse.FromString(lane.call(RELEASE, pb.ReleaseRequest(
        session_id=session, lease_ids=[answer.lease_id]).SerializeToString()))
    assert len(np.frombuffer(answer.keys.data, "<u8")) == 4 and not released.stale_lease_ids
    assert pool_calls == []
    stub.Select(pb.SelectRequest(session_id=session, num_samples=2, packed=True), timeout=10)
    assert "sample_batches" in pool_calls
    lane.close()
    client.close()


def test_answer_frames_in_pieces_with_waits_between_them():
    """A large answer (a Select of many items) arrives in many pieces, with the caller's waits timing out in
    between: what came is kept, and the payload comes out whole and exact."""
    from gear_client.connection.lane_client import _Answer
    from gear_contract.lane_frames import HEAD

    payload = np.random.default_rng(3).integers(0, 256, 700_000, dtype=np.uint8).tobytes()
    frame = HEAD.pack(len(payload) + 1, 0) + payload
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(True)
        answer = _Answer()
        with pytest.raises(TimeoutError):
            answer.read(ours, 0.01)  # nothing sent yet
        # the head split, then uneven pieces (each under the socket's buffer: they are read in between)
        cuts = [0, 3, 5, 4096, 100_000, 100_001, *range(180_000, len(frame), 80_000), len(frame)]
        got = None
        for a, b in itertools.pairwise(cuts):
            theirs.sendall(frame[a:b])
            try:
                got = answer.read(ours, 0.2 if b == len(frame) else 0.01)
            except TimeoutError:
                continue
        assert got is not None and got[0] == 0 and bytes(got[1]) == payload
        small = b"xyz"  # a frame that comes in one piece
        theirs.sendall(HEAD.pack(len(small) + 1, 5) + small)
        assert answer.read(ours, 1.0) == (5, small)
        theirs.close()
        with pytest.raises(ConnectionResetError):
            answer.read(ours, 1.0)
    finally:
        ours.close()
        theirs.close()
