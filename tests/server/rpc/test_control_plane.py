"""The control plane at scale and under bad callers: a real daemon on loopback, real clients.

Hundreds of writers with open streams all finish, samplers blocked on a rate
limiter are released by the inserts they wait for while other calls go on,
configured limits refuse new calls at once naming their config key, callers
without the token cannot crowd out those with it, and oversized or slow sample
streams stay bounded. Every test is bounded in time and count.
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

import gear_client as reverb
from gear_contract import rate_limiters, selectors
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.channel import CHANNEL_OPTIONS
from gear_contract.wire import decode_sample_response
from gear_server.config import DaemonSettings
from gear_server.daemon import Daemon
from gear_server.ops import health
from gear_server.ops.auth import AuthSettings
from gear_server.rpc.limits import LimitSettings
from gear_server.serving import service
from tests.support.insert_streams import HeldStream, chunk_request, exhaust_chunk_budgets
from tests.support.open_writers import run_open_writers

pytestmark = pytest.mark.timeout(120)

PROMPT_S = 10.0
LEAF = pb.Structure(kind=pb.Structure.LEAF)


def table_config(name: str, limiter: rate_limiters.RateLimiter | None = None, max_size: int = 10_000,
                 sampler: selectors.Selector | None = None, max_times_sampled: int = 0) -> pb.TableConfig:
    return pb.TableConfig(name=name, sampler=(sampler or selectors.Uniform()).to_proto(),
                          remover=selectors.Fifo().to_proto(), max_size=max_size, max_times_sampled=max_times_sampled,
                          rate_limiter=(limiter or rate_limiters.MinSize(1)).to_proto())


class LoopbackDaemon:
    """A Daemon on 127.0.0.1 with its own shm folder, limits and auth as given."""

    def __init__(self, *tables: pb.TableConfig, limits: LimitSettings | None = None, token: str | None = None):
        self.shm_dir = f"/dev/shm/gear-test-{uuid.uuid4().hex[:10]}"
        os.makedirs(self.shm_dir)
        config = pb.ServerConfig(bind_address="127.0.0.1", port=0, shm_dir=self.shm_dir, instance_name="cp",
                                 tables=list(tables))
        settings = DaemonSettings.from_server_config(config)
        settings.limits = limits
        settings.auth = AuthSettings(token=token) if token else None
        self.daemon = Daemon(settings)
        self.port = self.daemon.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


@pytest.fixture
def make_daemon():
    made: list[LoopbackDaemon] = []

    def make(*tables, **kwargs) -> LoopbackDaemon:
        made.append(LoopbackDaemon(*tables, **kwargs))
        return made[-1]

    yield make
    for d in made:
        d.stop()


def size(stub, table: str, metadata=None) -> int:
    infos = stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S, metadata=metadata).table_info
    return next(t.current_size for t in infos if t.name == table)


# ------------------------------------------------------------------ many callers

def test_300_writers_with_open_streams_all_complete(make_daemon):
    """Each actor holds an open writer stream (one item acknowledged) until all 300 do, then writes 4 more."""
    actors, items = 300, 5
    d = make_daemon(table_config("t", max_size=actors * items, sampler=selectors.Fifo(), max_times_sampled=1))
    started = time.monotonic()
    failures = run_open_writers(d.address, actors, items, barrier_s=60, deadline_s=90)
    assert not failures, failures[:3]
    client = reverb.Client(d.address)
    assert client.server_info(timeout=PROMPT_S)["t"].current_size == actors * items
    values = sorted(int(s.data[0][0]) for s in client.sample("t", actors * items, emit_timesteps=False))
    assert values == list(range(actors * items))  # every item once, none lost
    assert time.monotonic() - started < 90


def test_100_samplers_blocked_on_a_rate_limiter_are_released_by_inserts(make_daemon):
    """SampleToInsertRatio(1, 1, 1): each insert allows one sample (each item goes to one sampler: fifo,
    max_times_sampled 1) and inserts may not run far ahead, so the inserter and the 100 blocked
    samplers must keep releasing each other."""
    samplers = 100
    d = make_daemon(table_config("r", rate_limiters.SampleToInsertRatio(1.0, 1, 1.0), sampler=selectors.Fifo(),
                                 max_times_sampled=1))
    got: list[int] = []
    failures: list[BaseException] = []

    def sampler() -> None:
        try:
            client = reverb.Client(d.address)
            got.extend(int(s.info.key) for s in client.sample("r", 1, emit_timesteps=False))
        except BaseException as e:  # noqa: BLE001
            failures.append(e)

    threads = [threading.Thread(target=sampler, daemon=True) for _ in range(samplers)]
    for t in threads:
        t.start()
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address))
    time.sleep(1.0)  # all of them waiting now
    started = time.monotonic()
    info = stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S).table_info[0]
    assert time.monotonic() - started < PROMPT_S / 2  # other calls are answered while they wait (got == [])
    assert info.rate_limiter_info.sample_stats.pending_wait_time_s > 0  # their waits show in the stats
    assert got == []
    released = time.monotonic()
    for key in range(1, samplers + 1):  # one stream: each insert waits for the samples it allows
        assert [k for r in stub.InsertStream(iter([chunk_request(key, np.zeros((1, 3), np.float32), "r")]),
                                            timeout=PROMPT_S) for k in r.keys] == [key]
    for t in threads:
        t.join(30)
    assert not failures, failures[:3]
    assert sorted(got) == list(range(1, samplers + 1))  # each item to exactly one sampler
    assert time.monotonic() - released < 30
    stats = stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S).table_info[0].rate_limiter_info
    assert stats.sample_stats.completed == samplers
    assert stats.sample_stats.limited >= samplers - 2 and stats.sample_stats.pending_wait_time_s == 0


def test_select_sessions_blocked_on_a_rate_limiter_are_released_too(make_daemon):
    from gear_contract.negotiation import local_host_id

    d = make_daemon(table_config("r", rate_limiters.SampleToInsertRatio(1.0, 1, 1.0), sampler=selectors.Fifo(),
                                 max_times_sampled=1))
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address))
    offer = pb.DataPlaneOffer(shm=True, host_id=local_host_id())
    sessions = [stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="r", offer=offer), timeout=PROMPT_S).session_id
                for _ in range(20)]
    pending = [stub.Select.future(pb.SelectRequest(session_id=s, num_samples=1), timeout=60) for s in sessions]
    time.sleep(0.5)
    assert not any(f.done() for f in pending)
    for key in range(1, 21):
        list(stub.InsertStream(iter([chunk_request(key, np.zeros((1, 3), np.float32), "r")]), timeout=PROMPT_S))
    answers = [f.result(timeout=30) for f in pending]
    keys = sorted(int(np.frombuffer(a.keys.data, "<u8")[0]) for a in answers)
    assert keys == list(range(1, 21))


def test_idle_streams_and_waiting_calls_hold_no_thread(make_daemon):
    d = make_daemon(table_config("t"), table_config("empty"))
    channel = grpc.insecure_channel(d.address)
    stub = pb_grpc.ReplayServiceStub(channel)
    assert size(stub, "t") == 0
    def daemon_threads() -> int:  # the daemon runs in this process; its threads are named gear-*
        return sum(t.name.startswith("gear-") for t in threading.enumerate())

    threads_before = daemon_threads()
    idle = [HeldStream(stub) for _ in range(200)]  # streams that never send
    waiting = [stub.Sample(pb.SampleRequest(table="empty", num_samples=1), timeout=60) for _ in range(100)]
    time.sleep(1.0)
    # At most the table pool's threads started (max_workers); none per call.
    assert daemon_threads() - threads_before <= d.daemon.settings.max_workers
    assert [k for r in stub.InsertStream(iter([chunk_request(1, np.ones((1, 3), np.float32))]), timeout=PROMPT_S)
            for k in r.keys] == [1]
    for call in waiting:
        call.cancel()
    for stream in idle:
        stream.close()
        list(stream.call)
    assert size(stub, "empty") == 0 and size(stub, "t") == 1


# ------------------------------------------------------------------ limits

def test_past_max_streams_a_new_call_is_refused_at_once_naming_the_key(make_daemon):
    d = make_daemon(table_config("t"), limits=LimitSettings(max_streams=6, max_health_streams=3))
    channel = grpc.insecure_channel(d.address)
    stub = pb_grpc.ReplayServiceStub(channel)
    held = [HeldStream(stub) for _ in range(6)]
    for i, stream in enumerate(held):  # each one served: an item acknowledged
        stream.send(chunk_request(i + 1, np.zeros((1, 3), np.float32)))
        assert list(next(stream.call).keys) == [i + 1]
    started = time.monotonic()
    extra = HeldStream(stub)
    error = extra.error()
    assert time.monotonic() - started < PROMPT_S / 2  # refused, not queued behind the held streams
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_streams" in error.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.ServerInfo(pb.ServerInfoRequest(), timeout=PROMPT_S)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Health has its own pool: it still answers, up to its own limit.
    health_stub = health.health_pb2_grpc.HealthStub(channel)
    watches = [health_stub.Watch(health.health_pb2.HealthCheckRequest(), timeout=60) for _ in range(3)]
    for w in watches:
        assert next(w).status == health.SERVING
    with pytest.raises(grpc.RpcError) as info:
        health_stub.Check(health.health_pb2.HealthCheckRequest(), timeout=PROMPT_S)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_health_streams" in info.value.details()

    # A stream that ends gives its slot back.
    held[0].close()
    list(held[0].call)
    assert size(stub, "t") == 6
    for w in watches:
        w.cancel()
    for stream in held[1:]:
        stream.close()
        list(stream.call)
    extra.close()


def test_chunk_bytes_past_the_stream_and_total_budgets_are_refused_naming_the_key(make_daemon):
    d = make_daemon(table_config("t"), limits=LimitSettings(max_stream_buffer_bytes=64 << 10,
                                                            max_buffered_bytes=96 << 10))
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address))
    block = np.zeros((16, 256), np.float32)  # 16 KiB a chunk
    # Released chunks do not count: many go through one stream.
    assert [k for r in stub.InsertStream(iter([chunk_request(k, block) for k in range(1, 21)]), timeout=PROMPT_S)
            for k in r.keys] == list(range(1, 21))
    # Chunks kept (never released) count: one stream's, then all streams'.
    exhaust_chunk_budgets(stub, block, 100)
    assert size(stub, "t") == 20 + 4 + 4 + 2  # what was acknowledged is in, nothing else


def test_thousands_of_streams_without_the_token_do_not_stop_authenticated_calls(make_daemon):
    token = "cp-token"
    auth = [("authorization", f"Bearer {token}")]
    d = make_daemon(table_config("t"), token=token)
    channels = [grpc.insecure_channel(d.address) for _ in range(4)]
    watches, inserts = [], []
    for n in range(2000):
        channel = channels[n % len(channels)]
        watches.append(health.health_pb2_grpc.HealthStub(channel).Watch(health.health_pb2.HealthCheckRequest(),
                                                                        timeout=60))
        inserts.append(pb_grpc.ReplayServiceStub(channel).InsertStream(iter(()), timeout=60))
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address))
    started = time.monotonic()
    keys = [k for r in stub.InsertStream(iter([chunk_request(1, np.ones((2, 3), np.float32))]), timeout=PROMPT_S,
                                         metadata=auth) for k in r.keys]
    assert keys == [1] and size(stub, "t", metadata=auth) == 1
    (response,) = stub.Sample(pb.SampleRequest(table="t", num_samples=1), timeout=PROMPT_S, metadata=auth)
    assert response.batch.info[0].key == 1
    assert time.monotonic() - started < PROMPT_S
    codes = {}
    for call in inserts:
        try:
            list(call)
        except grpc.RpcError as e:
            codes[e.code()] = codes.get(e.code(), 0) + 1
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: 2000}
    served = refused = 0
    for w in watches:  # the health pool holds its share; the others were refused at once
        if w.done():
            assert w.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            refused += 1
        else:
            served += 1
        w.cancel()
    assert served <= LimitSettings().max_health_streams and refused >= 2000 - LimitSettings().max_health_streams


# ------------------------------------------------------------------ sample streams

def test_max_items_per_message_is_capped_in_bytes(make_daemon, monkeypatch):
    monkeypatch.setattr(service, "MAX_SAMPLE_MESSAGE_BYTES", 1 << 20)
    d = make_daemon(table_config("t"))
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address, options=CHANNEL_OPTIONS))
    item = np.ones((64, 1024), np.float32)  # 256 KiB
    for key in range(1, 5):
        list(stub.InsertStream(iter([chunk_request(key, item)]), timeout=PROMPT_S))
    call = grpc.insecure_channel(d.address, options=CHANNEL_OPTIONS).unary_stream(
        "/gear.v1.ReplayService/Sample", request_serializer=pb.SampleRequest.SerializeToString)
    raw = list(call(pb.SampleRequest(table="t", num_samples=20, max_items_per_message=10**6), timeout=PROMPT_S))
    counts = [decode_sample_response(m).num_items for m in raw]
    assert sum(counts) == 20 and max(counts) == 4  # 1 MiB a message: 4 items, not a million
    assert all(len(m) <= (1 << 20) + 4096 for m in raw)


def test_a_slow_reader_of_a_sample_stream_costs_bounded_memory(make_daemon):
    d = make_daemon(table_config("t"))
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address, options=CHANNEL_OPTIONS))
    item = np.ones((256, 1024), np.float32)  # 1 MiB
    for key in range(1, 5):
        list(stub.InsertStream(iter([chunk_request(key, item)]), timeout=PROMPT_S))

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))

    before = rss()
    call = stub.Sample(pb.SampleRequest(table="t", num_samples=100_000, max_items_per_message=1), timeout=60)
    for _ in range(5):  # 5 MiB read of the 100 GB asked, slowly
        next(call)
        time.sleep(0.2)
    grown = rss() - before
    call.cancel()
    assert grown < 200 << 20, f"{grown >> 20} MiB"  # flow control holds the rest back
    assert size(stub, "t") == 4
    time.sleep(0.3)
    assert d.daemon.tables["t"].active_leases() == 0


def test_a_table_held_by_a_long_operation_does_not_stall_the_other_calls(make_daemon):
    """While a table's lock is held (a checkpoint copying it, a segment growing), calls on that table
    wait on the pool, and every other call (health, other tables) is answered at once."""
    d = make_daemon(table_config("busy"), table_config("other"))
    channel = grpc.insecure_channel(d.address)
    stub = pb_grpc.ReplayServiceStub(channel)
    list(stub.InsertStream(iter([chunk_request(1, np.ones((1, 3), np.float32), "other")]), timeout=PROMPT_S))
    lock = d.daemon.tables["busy"].lock  # what a snapshot or a regrowth holds
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)  # held until the other calls were answered: no race with the clock

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    waiting = [stub.CheckRateLimiter.future(pb.RateLimiterCheckRequest(table="busy", num_samples=1), timeout=30)]
    health_stub = health.health_pb2_grpc.HealthStub(channel)
    assert health_stub.Check(health.health_pb2.HealthCheckRequest(), timeout=5).status == health.SERVING
    (response,) = stub.Sample(pb.SampleRequest(table="other", num_samples=1), timeout=5)
    assert response.batch.info[0].key == 1
    assert holder.is_alive() and not release.is_set()  # answered while the lock is still held
    assert not waiting[0].done()
    release.set()
    holder.join(10)
    assert waiting[0].result(timeout=10).can_sample is False
