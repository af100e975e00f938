"""The stream plane on loopback: a learner that is "another host" (its host identity differs) reads over TCP.

Real daemons, real sockets, real learner processes. What the daemon must refuse
is sent on raw connections with the stream protocol's frames.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gear_client.data_planes.sampler import PlaneSampler
from gear_contract import negotiation
from gear_contract import stream_frames as frames
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.data_planes.settings import DataPlaneSettings
from tests.support.plane_daemon import PlaneDaemon, start_daemon, table_config
from tests.support.trajectories import check_batch, fill, insert

ROOT = Path(__file__).resolve().parents[2]
ELSEWHERE = "another-host"  # a host identity that is not the daemon's: shm is not offered


def _remote(address: str, **kwargs) -> PlaneSampler:
    return PlaneSampler(address, "t", host_id=ELSEWHERE, **kwargs)


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def daemon():
    d = start_daemon(table_config("t", 64), stream=True)
    try:
        fill(d.tables["t"], 64, length=32, dim=256)
        yield d
    finally:
        d.stop()


def test_a_remote_learner_negotiates_stream_and_gets_intact_batches(daemon):
    with _remote(f"localhost:{daemon.port}") as s:
        assert s.open() == "stream"
        assert sum(check_batch(s.sample(16)) for _ in range(4)) == 64
        got = 0
        for i, batch in enumerate(s.batches(8)):
            assert batch.plane == "stream"
            got += check_batch(batch)
            if i == 30:
                break
        assert got == 31 * 8 and s.stale_batches == 0
        assert len(s._reader.connections) == 4  # the default parallel connections
    assert _wait_for(lambda: daemon.manager.stream.connection_count() == 0)  # closing ended them
    assert len(daemon.manager.sessions) == 0


def test_windows_and_lengths_of_short_items_are_padded_like_the_other_planes(daemon):
    table = daemon.tables["t"]
    for seed in range(100, 108):
        insert(table, seed, length=5, dim=256)  # shorter than the layout's 32 steps
    with _remote(f"localhost:{daemon.port}") as s, PlaneSampler(f"localhost:{daemon.port}", "t") as local:
        assert local.open() == "shm"
        for window in (None, 4):
            remote_batch = s.sample(64, window=window)
            if window is None:  # the checksum covers whole items
                check_batch(remote_batch)
            by_key = {int(k): i for i, k in enumerate(remote_batch.keys)}
            shm_batch = local.sample(64, window=window)
            for j, key in enumerate(shm_batch.keys.tolist()):
                if key in by_key:
                    i = by_key[key]
                    for rc, lc in zip(remote_batch.columns, shm_batch.columns, strict=True):
                        assert np.array_equal(rc[i], lc[j])  # same bytes, same zero padding


def test_a_table_that_grows_into_new_segments_is_followed_without_a_torn_or_lost_batch():
    d = start_daemon(table_config("t", 8), stream=True)
    try:
        table = d.tables["t"]
        fill(table, 8, length=4, dim=16)
        with _remote(f"localhost:{d.port}") as s:
            assert s.open() == "stream" and check_batch(s.sample(8)) == 8
            first = table.layout().version
            for seed in range(100, 108):  # longer items: the table relearns its layout into a new segment
                insert(table, seed, length=12, dim=16)
            batches = [s.sample(8) for _ in range(3)]
            assert table.layout().version > first and s.kind == "stream"
            assert all(check_batch(b) == 8 and b.columns[1].shape == (8, 12, 16) for b in batches)
            got = 0
            for i, batch in enumerate(s.batches(4)):  # pipelined, while it grows once more
                got += check_batch(batch)
                if i == 5:
                    for seed in range(200, 208):
                        insert(table, seed, length=20, dim=16)
                if i == 40:
                    break
            assert got == 41 * 4 and s.kind == "stream"
    finally:
        d.stop()


def test_a_superseded_segment_file_is_closed_once_its_leases_can_have_ended():
    d = start_daemon(table_config("t", 8), stream=True, lease_timeout_s=0.5)
    try:
        table = d.tables["t"]
        fill(table, 8, length=4, dim=16)
        with _remote(f"localhost:{d.port}") as s:
            assert check_batch(s.sample(8)) == 8
            grant = s._session and d.manager.sessions.get(s._session.session_id).resources
            first = table.layout().version
            for seed in range(100, 108):
                insert(table, seed, length=12, dim=16)  # a new segment
            assert check_batch(s.sample(8)) == 8
            assert sorted(grant.files) == [first, table.layout().version]  # the old one kept a while
            time.sleep(0.8)
            assert check_batch(s.sample(8)) == 8
            assert sorted(grant.files) == [table.layout().version]  # then closed: its memory is not held
    finally:
        d.stop()


def test_the_operator_can_turn_the_stream_plane_off():
    d = start_daemon(table_config("t", 8), stream=DataPlaneSettings(stream=False))
    try:
        fill(d.tables["t"], 8, length=8, dim=16)
        assert "stream ([data_planes] stream = false)" in d.manager.report.line()
        with _remote(f"localhost:{d.port}") as s:
            assert s.open() == "inline" and check_batch(s.sample(4)) == 4
    finally:
        d.stop()


def test_stream_is_preferred_over_inline_and_below_shm_and_rdma():
    offer = negotiation.build_offer(negotiation.PLANES, "x", None)
    assert offer.stream and offer.inline
    assert negotiation.choose_plane(offer, "h", False, daemon_has_stream=True) == negotiation.STREAM
    assert negotiation.choose_plane(offer, "x", False, daemon_has_stream=True) == negotiation.SHM
    assert negotiation.choose_plane(offer, "h", False, daemon_has_stream=False) == negotiation.INLINE
    with pytest.raises(negotiation.NoCommonPlaneError, match="serves no streams"):
        negotiation.choose_plane(negotiation.build_offer([negotiation.STREAM], "x", None), "h", False,
                                 daemon_has_stream=False)


# ------------------------------------------------------------------ raw protocol --


class RawStream:
    """A session opened over gRPC, and raw stream connections speaking the frames by hand."""

    def __init__(self, d):
        self.channel = __import__("grpc").insecure_channel(f"localhost:{d.port}")
        self.stub = pb_grpc.ReplayServiceStub(self.channel)
        offer = negotiation.build_offer([negotiation.STREAM], ELSEWHERE, None)
        self.opened = self.stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="t", offer=offer))
        assert self.opened.kind == "stream"
        self.layout = self.opened.layout
        self.port = self.opened.stream.port

    def connect(self, credential: bytes | None = None, session_id: str | None = None) -> socket.socket:
        sock = socket.create_connection(("localhost", self.port), timeout=10)
        sock.sendall(frames.hello(session_id or self.opened.session_id, credential or self.opened.stream.credential))
        return sock

    def select(self, n: int) -> pb.SelectResponse:
        return self.stub.Select(pb.SelectRequest(session_id=self.opened.session_id, num_samples=n))

    def close(self) -> None:
        self.stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=self.opened.session_id))
        self.channel.close()


def _slots(response: pb.SelectResponse) -> np.ndarray:
    return np.frombuffer(response.slots.data, dtype="<i8")


def _ask(sock: socket.socket, lease: int, version: int, windows) -> tuple[int, bytes | str]:
    sock.sendall(frames.read_request(lease, version, np.asarray(windows, dtype=np.int64).reshape(-1, 3)))
    status, size, message = frames.read_answer(sock)
    if status != frames.OK:
        return status, message
    return status, frames.recv_bytes(sock, size)


def test_a_wrong_or_missing_credential_is_refused(daemon):
    raw = RawStream(daemon)
    try:
        wrong = raw.connect(credential=bytes(32))
        status, _, message = frames.read_answer(wrong)
        assert status == frames.REFUSED and "credential" in message
        assert wrong.recv(1) == b""  # and the connection is closed
        unknown = raw.connect(session_id="0" * 32)
        assert frames.read_answer(unknown)[0] == frames.REFUSED
        garbage = socket.create_connection(("localhost", raw.port), timeout=10)
        garbage.sendall(b"GET / HTTP/1.1\r\n" + bytes(frames.HELLO.size))
        assert garbage.recv(1) == b""  # not a gear stream: dropped without an answer
        silent = socket.create_connection(("localhost", raw.port), timeout=20)  # never says hello
        good = raw.connect()
        assert frames.read_answer(good)[0] == frames.OK  # the others did not block the listener
        for s in (wrong, unknown, garbage, silent, good):
            s.close()
    finally:
        raw.close()
    # the credential dies with its session
    late = socket.create_connection(("localhost", raw.port), timeout=10)
    late.sendall(frames.hello(raw.opened.session_id, raw.opened.stream.credential))
    assert frames.read_answer(late)[0] == frames.REFUSED
    late.close()


def test_bad_windows_are_refused_and_nothing_outside_the_lease_or_segment_is_read(daemon):
    raw = RawStream(daemon)
    try:
        sock = raw.connect()
        assert frames.read_answer(sock)[0] == frames.OK
        picked = raw.select(4)
        lease, version = picked.lease_id, picked.layout_version
        layout = raw.layout
        col = layout.columns[1]  # obs
        leased = _slots(picked)
        slot = int(leased[0])
        unleased = next(s for s in range(layout.capacity) if s not in set(leased.tolist()))
        start = col.offset + slot * col.slot_stride
        whole = col.max_length * col.step_bytes
        segment = np.fromfile(layout.segment, dtype=np.uint8)
        # a good window: exactly the segment's bytes
        status, data = _ask(sock, lease, version, [slot, start, whole])
        assert status == frames.OK and data == segment[start:start + whole].tobytes()
        refused = {
            "unleased slot": (lease, version, [unleased, col.offset + unleased * col.slot_stride, 64]),
            "past the slot's column": (lease, version, [slot, start, whole + 128]),
            "another slot's bytes": (lease, version, [slot, col.offset + unleased * col.slot_stride, 64]),
            "negative offset": (lease, version, [slot, -128, 64]),
            "zero length": (lease, version, [slot, start, 0]),
            "negative length": (lease, version, [slot, start, -5]),
            "past the segment": (lease, version, [slot, layout.segment_size - 8, 64]),
            "huge length": (lease, version, [slot, start, 1 << 62]),
            "unknown lease": (lease + 1000, version, [slot, start, 64]),
            "unknown layout": (lease, version + 7, [slot, start, 64]),  # LAYOUT_GONE
        }
        for name, (lease_id, v, window) in refused.items():
            status, message = _ask(sock, lease_id, v, window)
            assert status != frames.OK, name
            assert isinstance(message, str) and message, name
        # one bad window among good ones: the whole READ is refused, nothing sent
        status, _ = _ask(sock, lease, version, [[slot, start, 64], [unleased, col.offset, 64]])
        assert status == frames.OUT_OF_BOUNDS
        # the connection is still in step after the refusals
        status, data = _ask(sock, lease, version, [[slot, start, 256], [slot, start + 512, 256]])
        assert data == segment[start:start + 256].tobytes() + segment[start + 512:start + 768].tobytes()
        # after Release the lease is gone: nothing more is sent under it
        raw.stub.Release(pb.ReleaseRequest(session_id=raw.opened.session_id, lease_ids=[lease]))
        assert _ask(sock, lease, version, [slot, start, 64])[0] == frames.LEASE_GONE
        # more windows than a READ may carry: refused and the connection dropped
        sock.sendall(frames.READ.pack(frames.READ_MAGIC, frames.MAX_WINDOWS + 1, lease, version))
        assert frames.read_answer(sock)[0] == frames.BAD_REQUEST
        assert sock.recv(1) == b""
        sock.close()
    finally:
        raw.close()


def test_a_session_has_at_most_its_connections_and_closing_it_drops_them(daemon):
    raw = RawStream(daemon)
    socks = []
    try:
        for _ in range(raw.opened.stream.connections):
            socks.append(raw.connect())
            assert frames.read_answer(socks[-1])[0] == frames.OK
        extra = raw.connect()
        status, _, message = frames.read_answer(extra)
        assert status == frames.BUSY and "connections" in message
        extra.close()
    finally:
        raw.close()
    for s in socks:
        s.settimeout(10)
        assert s.recv(1) == b""  # the session's close shut them down
        s.close()
    assert _wait_for(lambda: daemon.manager.stream.connection_count() == 0)


def test_a_learner_that_stops_reading_loses_its_connection_after_the_stall_timeout():
    d = start_daemon(table_config("t", 16), stream=DataPlaneSettings(stream_stall_timeout_s=1))
    try:
        fill(d.tables["t"], 16, length=64, dim=4096)  # 1 MiB items
        raw = RawStream(d)
        sock = raw.connect()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert frames.read_answer(sock)[0] == frames.OK
        picked = raw.select(16)
        col = raw.layout.columns[1]
        windows = [[s, col.offset + int(s) * col.slot_stride, col.max_length * col.step_bytes] for s in _slots(picked)]
        sock.sendall(frames.read_request(picked.lease_id, picked.layout_version, np.array(windows)))
        # 16 MiB asked, never read: the daemon's send stalls and gives up; its thread ends
        assert _wait_for(lambda: d.manager.stream.connection_count() == 0, timeout=15)
        # and the session, whose only connection went, is closed with its lease
        assert _wait_for(lambda: len(d.manager.sessions) == 0) and d.manager.sessions.active_leases() == 0
        sock.close()
        raw.channel.close()
    finally:
        d.stop()


# ------------------------------------------------------------------ churn, death, restart --


def test_items_are_never_torn_under_insert_churn():
    d = start_daemon(table_config("t", 16), stream=True)
    stop = threading.Event()
    inserted = [0]

    def churn() -> None:
        seed = 1000
        while not stop.is_set():
            insert(d.tables["t"], seed, length=32, dim=2048)  # 256 KiB items, evicting as fast as it can
            seed += 1
            inserted[0] += 1

    try:
        fill(d.tables["t"], 16, length=32, dim=2048)
        writer = threading.Thread(target=churn)
        writer.start()
        checked = 0
        deadline = time.monotonic() + 60  # a bound for a loaded machine; it takes seconds
        with _remote(f"localhost:{d.port}") as s:
            for batch in s.batches(8):
                checked += check_batch(batch)
                if (checked >= 200 and inserted[0] >= 100) or time.monotonic() > deadline:
                    break
            for _ in range(20):
                checked += check_batch(s.sample(8))
    finally:
        stop.set()
        writer.join()
        d.stop()
    assert checked >= 360 and inserted[0] >= 100, (checked, inserted[0])


_LEARNER = """
import sys, time
from gear_client.data_planes.sampler import PlaneSampler
s = PlaneSampler(sys.argv[1], "t", host_id="another-host")
assert s.open() == "stream"
print("ready", flush=True)
for b in s.batches(16):
    pass
"""


def test_a_learner_killed_mid_stream_is_reaped_and_the_daemon_keeps_serving(daemon):
    address = f"localhost:{daemon.port}"
    proc = subprocess.Popen([sys.executable, "-c", _LEARNER, address], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert _wait_for(lambda: daemon.manager.stream.connection_count() == 4)
        time.sleep(0.5)  # batches flowing
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # its connections ended, so its session (and leases) went at once, not after the idle timeout
    assert _wait_for(lambda: daemon.manager.stream.connection_count() == 0)
    assert _wait_for(lambda: len(daemon.manager.sessions) == 0)
    assert daemon.manager.sessions.active_leases() == 0
    with _remote(address) as s:
        assert s.open() == "stream" and check_batch(s.sample(32)) == 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_daemon_restarted_mid_stream_fails_the_read_clearly_then_the_learner_recovers():
    from gear_client.errors import ReverbError
    port = _free_port()

    def start():
        config = pb.ServerConfig(port=port, bind_address="localhost", instance_name=f"restart{os.getpid()}",
                                 tables=[table_config("t", 32)])
        d = PlaneDaemon(config, stream=True)
        d.start()
        fill(d.tables["t"], 32, length=64, dim=4096)  # 1 MiB items: a stop lands mid-transfer
        return d

    d = start()
    s = _remote(f"localhost:{port}")
    outcome: dict = {}

    def learn() -> None:
        try:
            for batch in s.batches(32):
                outcome["batches"] = outcome.get("batches", 0) + 1
                check_batch(batch)
        except BaseException as exc:  # noqa: BLE001 - the test looks at what ended it
            outcome["error"] = exc

    try:
        assert s.open() == "stream"
        learner = threading.Thread(target=learn)
        learner.start()
        assert _wait_for(lambda: outcome.get("batches", 0) >= 3, timeout=60)
        d.stop()
        learner.join(timeout=60)
        assert not learner.is_alive()  # the read ended, it did not hang
        error = outcome["error"]
        assert isinstance(error, (ReverbError, ConnectionError)), repr(error)
        assert any(word in str(error).lower() for word in ("unavailable", "lost", "refused", "closed")), str(error)
        d = start()
        deadline = time.monotonic() + 60
        while True:  # the channel reconnects (gRPC's backoff), the stale session is re-opened on the new daemon
            try:
                assert check_batch(s.sample(8)) == 8
                break
            except ReverbError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert s.kind == "stream", (s._excluded, repr(error))
    finally:
        s.close()
        d.stop()


def test_tls_control_plane_means_tls_bulk_streams(pki, monkeypatch):
    from dataclasses import replace

    from gear_client.connection.auth import ChannelSecurity
    from gear_server.config import DaemonSettings
    from gear_server.ops.auth import AuthSettings

    auth = AuthSettings(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"))
    config = pb.ServerConfig(port=0, bind_address="localhost", instance_name=f"tls{os.getpid()}",
                             tables=[table_config("t", 16)])
    settings = replace(DaemonSettings.from_server_config(config), auth=auth)
    d = PlaneDaemon(settings, stream=True)
    d.start()
    try:
        fill(d.tables["t"], 16, length=16, dim=256)
        assert d.manager.stream.tls
        monkeypatch.setenv("GEAR_TLS_ROOT_CERTS", str(pki / "ca.crt"))
        channel = ChannelSecurity.build().channel(f"localhost:{d.port}")
        with PlaneSampler(channel, "t", host_id=ELSEWHERE) as bare:  # no address known: stream not offered
            assert bare.open() == "inline"
        channel.close()
        with _remote(f"localhost:{d.port}") as s:
            assert s.open() == "stream" and s._reader.connections[0].sock.version().startswith("TLS")
            assert check_batch(s.sample(16)) == 16
        # a plaintext client on the TLS listener gets no gear answer
        raw = socket.create_connection(("localhost", d.manager.stream.port), timeout=10)
        raw.sendall(frames.hello("0" * 32, bytes(32)))
        raw.settimeout(10)
        try:
            reply = raw.recv(64)
        except ConnectionResetError:
            reply = b""
        assert reply[:4] != b"GEAR"
        raw.close()
    finally:
        d.stop()
