"""Ingest workers under many and bad callers: real daemons, real worker processes, real clients on loopback.

The workers serve InsertStream on grpc.aio as the daemon does: hundreds of open
writer streams through two workers all complete, idle streams hold no worker
thread, streams a rate limiter holds do not hold up another table's inserts,
the daemon's ``[limits]`` and ``[auth]`` apply with the same statuses and
messages, a writer's resend through a worker after a daemon restart leaves a
key the table holds as it is, and the workers end when their daemon dies.
Every test is bounded in time and count.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import gear_client as reverb
from gear_contract import rate_limiters
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.checkpoint.settings import CheckpointSettings
from gear_server.config import DaemonSettings
from gear_server.daemon import Daemon
from gear_server.ingest.settings import IngestSettings
from gear_server.ingest.worker_pool import WorkerPool
from gear_server.ingest.worker_process import DEFAULT_THREADS, WRITER_IDLE_S
from gear_server.ops.auth import AuthSettings
from gear_server.rpc.limits import LimitSettings
from tests.support.daemon_process import DaemonProcess
from tests.support.insert_plane import items_in_insert_order, slots_accounted
from tests.support.insert_streams import HeldStream, chunk_request, exhaust_chunk_budgets
from tests.support.open_writers import run_open_writers
from tests.support.plane_daemon import table_config
from tests.support.trajectories import STRUCTURE, item_ok, make_item

pytestmark = pytest.mark.timeout(180)

PROMPT_S = 10.0
NETWORK_PATH = "GEAR_INSERT_PLANE"  # "0": writers on this host behave as remote ones (InsertStream to a worker)
_instances = iter(range(1 << 30))


def start(*tables: pb.TableConfig, auth: AuthSettings | None = None, checkpoint_dir: Path | None = None,
          instance: str | None = None, **ingest) -> Daemon:
    """A daemon on loopback with ``[ingest]`` as given (and auth, checkpoints when given)."""
    config = pb.ServerConfig(port=0, bind_address="localhost", tables=list(tables),
                             instance_name=instance or f"wstest{os.getpid()}x{next(_instances)}")
    settings = DaemonSettings.from_server_config(config)
    settings.ingest = IngestSettings(**ingest)
    settings.auth = auth
    if checkpoint_dir is not None:
        settings.checkpoint = CheckpointSettings(dir=str(checkpoint_dir))
    daemon = Daemon(settings, seed=0)
    daemon.start()
    return daemon


def worker_stub(port: int) -> pb_grpc.ReplayServiceStub:
    return pb_grpc.ReplayServiceStub(grpc.insecure_channel(f"localhost:{port}"))


def item_request(key: int, seed: int, *, table: str = "t", priority: float = 1.0, resend: bool = False,
                 length: int = 4, dim: int = 8) -> pb.InsertStreamRequest:
    """One checksummed trajectory (columns action, obs, reward) as a self-contained request."""
    item = make_item(seed, length, dim)
    request = pb.InsertStreamRequest()
    message = request.items.add(key=key, table=table, priority=priority, structure=STRUCTURE, resend=resend)
    for c, name in enumerate(("action", "obs", "reward")):
        data = item[name]
        chunk_key = 3 * key + c
        request.chunks.add(chunk_key=chunk_key, episode_id=key,
                           data=pb.Tensor(dtype=data.dtype.str, shape=list(data.shape), data=data.tobytes()))
        message.columns.add().slices.add(chunk_key=chunk_key, offset=0, length=length)
        request.release_chunk_keys.append(chunk_key)
    return request


def keys_of(stub: pb_grpc.ReplayServiceStub, *requests: pb.InsertStreamRequest, metadata=None) -> list[int]:
    return [k for r in stub.InsertStream(iter(requests), timeout=PROMPT_S, metadata=metadata) for k in r.keys]


def priority_of(table, key: int) -> float:
    return float(table.meta.priority[table.slot_of(key)])


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for pid {pid}")


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def daemons():
    made: list[Daemon] = []

    def make(*tables, **kwargs) -> Daemon:
        made.append(start(*tables, **kwargs))
        return made[-1]

    yield make
    for d in made:
        d.stop()


# ------------------------------------------------------------------ many callers

def test_300_open_writer_streams_through_two_workers_all_complete(daemons, monkeypatch):
    """Each actor holds its writer stream to a worker open (one item acknowledged) until all 300 do, then
    writes 4 more: a worker serving streams on threads would leave those past its thread count waiting."""
    monkeypatch.setenv(NETWORK_PATH, "0")
    actors, items = 300, 5
    d = daemons(table_config("t", actors * items, sampler="fifo", max_times_sampled=1), workers=2)
    started = time.monotonic()
    failures = run_open_writers(d.address(), actors, items, barrier_s=90, deadline_s=120)
    assert not failures, failures[:3]
    assert time.monotonic() - started < 120
    table = d.tables["t"]
    assert table.size() == actors * items
    client = reverb.Client(d.address())
    values = sorted(int(s.data[0][0]) for s in client.sample("t", actors * items, emit_timesteps=False))
    assert values == list(range(actors * items))  # every item once, none lost
    # through both workers, and (but for first items that came before the layout was fixed) the insert plane
    assert {p.pid for p in d.ingest.pool.processes} <= d.ingest.plane.writer_pids
    assert d.ingest.plane.items_committed >= actors * (items - 1)
    assert slots_accounted(table)


def test_idle_streams_hold_no_worker_thread(daemons):
    d = daemons(table_config("t", 64), workers=1)
    port, pid = d.ingest.ports()[0], d.ingest.pool.processes[0].pid
    stub = worker_stub(port)
    assert keys_of(stub, item_request(1, 1)) == [1]
    threads_before = threads_of(pid)
    idle = [HeldStream(stub) for _ in range(200)]  # streams that never send
    served = [HeldStream(stub) for _ in range(20)]  # streams served once, then idle
    for i, stream in enumerate(served):
        stream.send(item_request(100 + i, 100 + i))
        assert list(next(stream.call).keys) == [100 + i]
    time.sleep(0.5)
    # at most the copying threads (and a writer's two) started; none per stream
    assert threads_of(pid) - threads_before <= DEFAULT_THREADS + 2
    assert keys_of(stub, item_request(2, 2)) == [2]
    for stream in idle + served:
        stream.close()
        list(stream.call)
    assert d.tables["t"].size() == 22


def test_streams_a_rate_limiter_holds_do_not_hold_up_another_tables_inserts(daemons):
    """More streams than the worker has copying threads wait on table 'r''s rate limiter; an insert into
    table 't' through the same worker is answered meanwhile, and sampling 'r' lets them all in."""
    held_streams = DEFAULT_THREADS + 4
    limited = table_config("r", 256, rate_limiter=rate_limiters.SampleToInsertRatio(1.0, 1, 1.0).to_proto())
    d = daemons(limited, table_config("t", 64), workers=1)
    stub = worker_stub(d.ingest.ports()[0])
    assert keys_of(stub, item_request(1, 1, table="r")) == [1]  # layouts fixed: later items take the plane
    assert keys_of(stub, item_request(1, 1, table="t")) == [1]
    streams = [HeldStream(stub) for _ in range(held_streams)]
    acked: list[int] = []

    def read(stream: HeldStream) -> None:
        acked.extend(next(stream.call).keys)

    readers = []
    for i, stream in enumerate(streams):
        stream.send(item_request(100 + i, 100 + i, table="r"))
        readers.append(threading.Thread(target=read, args=(stream,), daemon=True))
        readers[-1].start()
    deadline = time.monotonic() + PROMPT_S
    while d.tables["r"].info().rate_limiter_info.insert_stats.pending_wait_time_s == 0:
        assert time.monotonic() < deadline, "no insert waits on the rate limiter"
        time.sleep(0.05)
    time.sleep(0.5)
    assert len(acked) <= 2  # the limiter lets inserts run 2 ahead of samples
    started = time.monotonic()
    assert keys_of(stub, item_request(2, 2, table="t")) == [2]
    assert time.monotonic() - started < 5.0
    client = reverb.Client(d.address())
    deadline = time.monotonic() + 60
    while len(acked) < held_streams:
        assert time.monotonic() < deadline, f"{len(acked)} of {held_streams} acknowledged"
        next(client.sample("r", 1, emit_timesteps=False))
        time.sleep(0.02)
    for t in readers:
        t.join(PROMPT_S)
    assert sorted(acked) == list(range(100, 100 + held_streams))
    assert d.tables["r"].size() == held_streams + 1
    for stream in streams:
        stream.close()
        list(stream.call)


def test_a_writer_that_leaves_while_the_rate_limiter_holds_its_items_leaves_nothing_behind(daemons):
    limited = table_config("r", 256, rate_limiter=rate_limiters.SampleToInsertRatio(1.0, 1, 1.0).to_proto())
    d = daemons(limited, workers=1)
    table = d.tables["r"]
    stub = worker_stub(d.ingest.ports()[0])
    assert keys_of(stub, item_request(1, 1, table="r"), item_request(2, 2, table="r")) == [1, 2]  # 2 ahead
    gone = HeldStream(stub)
    gone.send(item_request(100, 100, table="r"))
    deadline = time.monotonic() + PROMPT_S
    while table.info().rate_limiter_info.insert_stats.pending_wait_time_s == 0:
        assert time.monotonic() < deadline, "the insert does not wait on the rate limiter"
        time.sleep(0.05)
    gone.call.cancel()
    time.sleep(0.5)
    client = reverb.Client(d.address())
    next(client.sample("r", 1, emit_timesteps=False))  # room for one insert: not the abandoned one
    assert keys_of(stub, item_request(200, 200, table="r")) == [200]
    assert sorted(table.keys()) == [1, 2, 200]
    assert slots_accounted(table)


def test_idle_writers_give_their_reserved_slots_back(daemons):
    d = daemons(table_config("t", 64), workers=1)
    stub = worker_stub(d.ingest.ports()[0])
    assert keys_of(stub, *[item_request(k, k) for k in range(1, 6)]) == [1, 2, 3, 4, 5]
    assert d.ingest.plane.outstanding() > 0  # the worker's writer keeps slots reserved for the next items
    deadline = time.monotonic() + WRITER_IDLE_S + 5
    while d.ingest.plane.outstanding():
        assert time.monotonic() < deadline, "reservations of an idle worker were not given back"
        time.sleep(0.1)
    assert slots_accounted(d.tables["t"]) and d.tables["t"].size() == 5


# ------------------------------------------------------------------ limits, auth, bad bytes

def test_worker_limits_refuse_new_calls_and_bytes_naming_the_key(daemons):
    d = daemons(table_config("t", 1024), workers=1)  # binds the socket the workers commit through
    pool = WorkerPool(1, f"unix:{d.ingest.socket_path}", "localhost", None, limits=LimitSettings(
        max_streams=4, max_stream_buffer_bytes=64 << 10, max_buffered_bytes=96 << 10))
    try:
        stub = worker_stub(pool.start()[0])
        block = np.zeros((16, 256), np.float32)  # 16 KiB a chunk
        # Released chunks do not count: many go through one stream.
        assert keys_of(stub, *[chunk_request(k, block) for k in range(1, 21)]) == list(range(1, 21))

        held = [HeldStream(stub) for _ in range(4)]
        for i, stream in enumerate(held):  # each one served: an item acknowledged
            stream.send(chunk_request(100 + i, block))
            assert list(next(stream.call).keys) == [100 + i]
        started = time.monotonic()
        error = HeldStream(stub).error()
        assert time.monotonic() - started < PROMPT_S / 2  # refused, not queued behind the held streams
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_streams" in error.details()
        for stream in held:
            stream.close()
            list(stream.call)

        # Chunks kept (never released) count: one stream's, then all streams' (as on the daemon).
        exhaust_chunk_budgets(stub, block, 200)
        assert d.tables["t"].size() == 20 + 4 + 4 + 4 + 2  # what was acknowledged is in, nothing else
    finally:
        pool.stop()


def test_a_worker_checks_the_daemons_token(daemons):
    d = daemons(table_config("t", 64), workers=1, auth=AuthSettings(token="worker-token"))
    stub = worker_stub(d.ingest.ports()[0])
    for metadata, reason in ((None, "missing bearer token"),
                             ([("authorization", "Bearer nope")], "wrong bearer token")):
        with pytest.raises(grpc.RpcError) as info:
            keys_of(stub, item_request(1, 1), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason in info.value.details()
    assert d.tables["t"].size() == 0
    good = [("authorization", "Bearer worker-token")]
    assert keys_of(stub, item_request(1, 1), item_request(2, 2), metadata=good) == [1, 2]
    assert d.tables["t"].size() == 2


def test_undecodable_bytes_end_the_stream_invalid_argument_and_the_worker_goes_on(daemons):
    d = daemons(table_config("t", 64), workers=1)
    channel = grpc.insecure_channel(f"localhost:{d.ingest.ports()[0]}")
    raw = channel.stream_stream("/gear.v1.ReplayService/InsertStream", request_serializer=None,
                                response_deserializer=pb.InsertStreamResponse.FromString)
    good = item_request(1, 1).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        list(raw(iter([good, b"\x0a\xff\xff\xff\x0f"]), timeout=PROMPT_S))  # a chunk longer than the message
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 1" in info.value.details() and "not a valid request message" in info.value.details()
    assert [k for r in raw(iter([item_request(2, 2).SerializeToString()]), timeout=PROMPT_S) for k in r.keys] == [2]
    assert sorted(d.tables["t"].keys()) == [1, 2]  # the first request's item, acknowledged or not
    channel.close()


# ------------------------------------------------------------------ restarts

def test_a_resend_through_a_worker_after_a_daemon_restart_is_applied_once(tmp_path):
    """A writer whose acknowledgements were lost resends its items (marked) on a new stream: through a
    worker of the restarted daemon, a key the table holds (from the checkpoint) keeps its priority and
    is not inserted again; a key it lacks goes in; order within a request is kept."""
    instance = f"wsrestart{os.getpid()}"
    config = table_config("t", 64)
    first = start(config, workers=1, checkpoint_dir=tmp_path, instance=instance)
    try:
        stub = worker_stub(first.ingest.ports()[0])
        assert keys_of(stub, item_request(1, 1, priority=1.0), item_request(2, 2, priority=2.0)) == [1, 2]
    finally:
        first.stop()  # the final checkpoint holds keys 1 and 2
    second = start(config, workers=1, checkpoint_dir=tmp_path, instance=instance)
    try:
        table = second.tables["t"]
        assert table.size() == 2
        stub = worker_stub(second.ingest.ports()[0])
        # resent: 1 (held: left as it is), 3 (lost with the old daemon: inserted), between fresh items
        acked = keys_of(stub, item_request(4, 4, priority=4.0), item_request(1, 1, priority=9.0, resend=True),
                        item_request(3, 3, priority=3.0, resend=True), item_request(5, 5, priority=5.0))
        assert acked == [4, 1, 3, 5]
        assert table.size() == 5
        assert {k: priority_of(table, k) for k in range(1, 6)} == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}
        # the same key again, marked again: still left as it is; unmarked: Reverb's priority update
        assert keys_of(stub, item_request(2, 2, priority=8.0, resend=True)) == [2]
        assert priority_of(table, 2) == 2.0
        assert keys_of(stub, item_request(2, 2, priority=7.0)) == [2]
        assert priority_of(table, 2) == 7.0 and table.size() == 5
        items = items_in_insert_order(table)
        assert [int(i["action"][0]) for i in items] == [1, 2, 4, 3, 5]  # insertion order: 4 before the resent 3
        assert all(item_ok(i["action"], i["obs"], i["reward"]) for i in items)
    finally:
        second.stop()


def test_workers_end_when_their_daemon_is_killed(tmp_path):
    daemon = DaemonProcess(tmp_path, f'''
bind_address = "127.0.0.1"
port = 0
instance_name = "wskill{os.getpid()}"

[[tables]]
name = "t"
preset = "queue"
max_size = 16

[ingest]
workers = 2
''')
    try:
        daemon.wait_ready()
        ports = list(pb_grpc.ReplayServiceStub(grpc.insecure_channel(daemon.address)).ServerInfo(
            pb.ServerInfoRequest(), timeout=PROMPT_S).ingest_ports)
        assert len(ports) == 2
        workers = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == daemon.process.pid and b"ingest.worker" in cmdline:
                    workers.append(int(entry.name))
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        os.kill(daemon.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while any(alive(pid) for pid in workers):
            assert time.monotonic() < deadline, "an ingest worker outlived its daemon"
            time.sleep(0.05)
    finally:
        daemon.close()


def test_a_streams_read_ahead_is_bounded_in_requests_and_bytes():
    """The worker reads a stream on while earlier items commit, but holds at most READ_AHEAD_BYTES
    (one request always) and READ_AHEAD_REQUESTS waiting: past that it stops reading the stream."""
    import asyncio

    from gear_server.ingest.worker_process import READ_AHEAD_REQUESTS, STREAM_END, ReadAhead

    big = pb.InsertStreamRequest(chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(data=b"\0" * (3 << 20)))])
    small = pb.InsertStreamRequest(release_chunk_keys=[7])
    yielded = []

    async def requests(items):
        for item in items:
            yielded.append(item)
            yield item

    async def scenario():
        ahead = ReadAhead()
        reader = asyncio.ensure_future(ahead.read(requests([big, big, big])))
        await asyncio.sleep(0.05)
        assert len(yielded) == 2  # the second 3 MiB request waits for room: the third is not read
        assert await ahead.take_all() == [big]
        await asyncio.sleep(0.05)
        assert await ahead.take_all() == [big]
        await asyncio.sleep(0.05)
        assert await ahead.take_all() == [big, STREAM_END]
        await reader
        yielded.clear()
        ahead = ReadAhead()
        count = READ_AHEAD_REQUESTS + 5
        reader = asyncio.ensure_future(ahead.read(requests([small] * count)))
        await asyncio.sleep(0.05)
        assert len(yielded) == READ_AHEAD_REQUESTS + 1  # one more read, waiting for room
        assert len(await ahead.take_all()) == READ_AHEAD_REQUESTS
        await asyncio.sleep(0.05)
        assert len(await ahead.take_all()) == 5 + 1  # the rest and the end
        await reader

    asyncio.run(scenario())
