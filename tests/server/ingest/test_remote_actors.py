"""Actors on another host (another host identity) insert over the stream plane: rows on a TCP connection.

Real daemons, real actor processes. The actor reserves and commits over its
InsertPlane stream as on the daemon's host; its rows go on one stream
connection and the daemon receives them straight into the reserved slot.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np

import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from gear_contract import nest
from gear_contract import stream_frames as frames
from gear_contract._proto import replay_pb2 as pb
from gear_contract.slot_writer import SlotWriter
from tests.support.insert_plane import intact, items_in_insert_order, run_actor, slots_accounted, start
from tests.support.paths import ROOT
from tests.support.plane_daemon import table_config
from tests.support.ports import free_port
from tests.support.trajectories import insert, item_ok, make_item

REMOTE = {"GEAR_HOST_ID": "a-remote-actor-host"}
SPECS = [(np.dtype(np.int64), (), False), (np.dtype(np.float32), (4,), False), (np.dtype(np.float32), (), False)]
STRUCTURE_BYTES = nest.structure_of({"obs": 0, "action": 0, "reward": 0}).SerializeToString()

# Reserves slots over a stream-writer InsertPlane, sends half of one item's rows on its row connection, then
# waits to be killed.
HALF_SENDER = """
import socket, sys, time
import grpc, numpy as np
from gear_contract import stream_frames as frames
from gear_contract.slot_writer import SlotWriter
from gear_contract import nest
w = SlotWriter(grpc.insecure_channel(sys.argv[1]), reserve_ahead=8, stream_host="localhost")
specs = [(np.dtype(np.int64), (), False), (np.dtype(np.float32), (4,), False), (np.dtype(np.float32), (), False)]
structure = nest.structure_of({"obs": 0, "action": 0, "reward": 0}).SerializeToString()
while not w.fits("t", specs, [4, 4, 4], structure):
    time.sleep(0.01)
while len(w._tables["t"].pool) < 8:
    time.sleep(0.01)
layout = w._tables["t"].mapping.layout
slot = w._tables["t"].pool[0][0]
ep = w._stream_endpoint
sock = socket.create_connection(("localhost", ep.port))
sock.sendall(frames.hello(ep.credential[:32].decode(), ep.credential[32:], frames.ROLE_WRITER))
assert frames.read_answer(sock)[0] == frames.OK
col = layout.columns[1]
sock.sendall(frames.write_request("t", slot, layout.version, np.array([[col.slot_offset(slot), 4 * 16]])))
sock.sendall(b"\\x07" * 32)  # half the rows
print("HALF", len(w._tables["t"].pool), flush=True)
time.sleep(120)
"""


def _wait(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_remote_actor_writes_over_the_stream_and_the_items_read_back_byte_exact():
    d = start(table_config("t", 64))
    try:
        result = run_actor(d.address(), 1000, 30, 8, 64, env=REMOTE)
        assert result["insert_plane"]  # the SlotWriter route, with its rows on a stream connection
        table = d.tables["t"]
        assert table.size() == 30
        assert d.ingest.plane.items_committed >= 25  # all but the first (it fixed the layout over InsertStream)
        for seed, item in zip(range(1000, 1030), items_in_insert_order(table), strict=True):
            want = make_item(seed, 8, 64)
            assert all(np.array_equal(item[k], want[k]) for k in want), seed
        with PlaneSampler(d.address(), "t") as learner:
            assert intact(learner.sample(16)) == 16
        assert _wait(lambda: d.ingest.plane.outstanding() == 0 and table.slot_counts().reserved == 0)
        assert slots_accounted(table)
        assert _wait(lambda: d.service.data_planes.stream.connection_count() == 0)  # its connection ended with it
    finally:
        d.stop()


def test_a_remote_actor_killed_mid_send_leaves_nothing_visible_and_no_slot_leaked():
    d = start(table_config("t", 32, spare=16))
    try:
        table = d.tables["t"]
        for seed in range(1, 5):
            insert(table, seed, length=4, dim=4)
        capacity = table.capacity
        actor = subprocess.Popen([sys.executable, "-c", HALF_SENDER, d.address()], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT), **REMOTE))
        try:
            line = actor.stdout.readline()
            assert line.startswith("HALF"), actor.stderr.read() if actor.poll() is not None else line
            assert d.ingest.plane.outstanding() == 8 and table.size() == 4  # reserved, half written: invisible
        finally:
            actor.send_signal(signal.SIGKILL)
            actor.wait(10)
        assert _wait(lambda: d.ingest.plane.outstanding() == 0 and table.slot_counts().reserved == 0)
        assert table.size() == 4 and slots_accounted(table)
        assert all(item_ok(i["action"], i["obs"], i["reward"]) for i in items_in_insert_order(table))
        assert _wait(lambda: d.service.data_planes.stream.connection_count() == 0)
        for seed in range(5, 5 + 60):  # the slots are usable: the table fills and evicts without growing
            insert(table, seed, length=4, dim=4)
        assert table.size() == 32 and table.capacity == capacity and slots_accounted(table)
    finally:
        d.stop()


def test_writes_outside_the_writers_reserved_slots_are_refused_and_nothing_is_written():
    d = start(table_config("t", 32, spare=16))
    channel = grpc.insecure_channel(d.address())
    w = None
    try:
        table = d.tables["t"]
        for seed in range(1, 5):
            insert(table, seed, length=4, dim=4)
        w = SlotWriter(channel, reserve_ahead=4, stream_host="localhost")
        assert w.fits("t", SPECS, [4, 4, 4], STRUCTURE_BYTES)
        assert _wait(lambda: len(w._tables["t"].pool) == 4)
        layout = w._tables["t"].mapping.layout
        mine = [s for s, _ in w._tables["t"].pool]
        other = next(s for s in range(layout.capacity) if s not in mine)
        ep = w._stream_endpoint
        sock = socket.create_connection(("localhost", ep.port), timeout=10)
        sock.sendall(frames.hello(ep.credential[:32].decode(), ep.credential[32:], frames.ROLE_WRITER))
        assert frames.read_answer(sock)[0] == frames.OK
        col = layout.columns[1]
        whole = col.max_length * col.step_bytes
        segment = table.segment.buffer
        before = bytes(segment)

        def write(slot: int, version: int, offset: int, data: bytes, table_name: str = "t") -> tuple[int, str]:
            sock.sendall(frames.write_request(table_name, slot, version, np.array([[offset, len(data)]])) + data)
            status, _, message = frames.read_answer(sock)
            return status, message

        refused = [
            write(other, layout.version, col.slot_offset(other), b"\x01" * 16),  # a slot not reserved here
            write(mine[0], layout.version, col.slot_offset(mine[0]) + whole - 8, b"\x02" * 16),  # past its column
            write(mine[0], layout.version, col.slot_offset(other), b"\x03" * 16),  # another slot's bytes
            write(mine[0], layout.version + 5, col.slot_offset(mine[0]), b"\x04" * 16),  # another layout
            write(mine[0], layout.version, col.slot_offset(mine[0]), b"\x05" * 16, "nope"),  # no such table
        ]
        assert all(status != frames.OK and message for status, message in refused), refused
        assert bytes(segment) == before  # nothing written anywhere
        # the connection is still in step: a good write lands where it should
        assert write(mine[0], layout.version, col.slot_offset(mine[0]), b"\x09" * 16)[0] == frames.OK
        after = bytes(segment)
        start_at = col.slot_offset(mine[0])
        assert after[start_at:start_at + 16] == b"\x09" * 16
        assert after[:start_at] == before[:start_at] and after[start_at + 16:] == before[start_at + 16:]
        assert table.size() == 4  # written, never committed: invisible
        # a WRITE claiming more than 2 GiB of rows is a protocol error: the connection is dropped
        sock.sendall(frames.write_request("t", mine[1], layout.version, np.array([[0, 1 << 32]])))
        sock.settimeout(10)
        assert sock.recv(1) == b""
        sock.close()
    finally:
        if w is not None:
            w.close()
        channel.close()
        d.stop()


def test_items_a_stopped_daemon_did_not_commit_reach_its_successor_without_duplicates(monkeypatch):
    """A remote writer's items held by the rate limiter when the daemon stops are sent again (their rows
    kept by the writer) over InsertStream to the daemon restarted on the same port: nothing lost or twice."""
    port = free_port()
    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1e12, max_diff=2.0)
    first = start(pb.TableConfig(name="t", max_size=64, sampler=pb.SelectorOptions(fifo=True),
                                 remover=pb.SelectorOptions(fifo=True), rate_limiter=limiter), port=port)
    monkeypatch.setenv("GEAR_HOST_ID", REMOTE["GEAR_HOST_ID"])  # this process is another host from now on
    second = None
    client = reverb.Client(f"localhost:{port}")
    writer = client.trajectory_writer(4, reconnect_timeout_s=30)
    try:
        for seed in range(1, 6):
            item = make_item(seed, 4, 4)
            for t in range(4):
                writer.append({k: v[t] for k, v in item.items()})
            writer.create_item("t", 1.0, {k: writer.history[k][-4:] for k in ("action", "obs", "reward")})
            if seed == 1:
                writer.flush()
        assert writer._same_host.writer._sender is not None  # rows over the stream plane
        plane = writer._same_host.writer

        def stuck() -> bool:  # the commit in flight is one the rate limiter holds (not item 2's alone)
            batch = plane._commit_in_flight
            return batch is not None and (len(batch.items) > 1 or plane.in_flight == 3)

        # items 1 and 2 in, 3 held by the rate limiter; item 2's commit may share 3's message (a remote
        # writer gathers commits while rows are on their way), and is then sent again with it
        assert _wait(lambda: first.tables["t"].size() == 2 and plane.in_flight in (3, 4) and stuck())
        first.stop()
        monkeypatch.delenv("GEAR_HOST_ID")
        second = start(table_config("t", 64), port=port)  # another host than the writer's, as before
        monkeypatch.setenv("GEAR_HOST_ID", REMOTE["GEAR_HOST_ID"])
        writer.flush(timeout_ms=30_000)
        items = items_in_insert_order(second.tables["t"])
        assert [int(i["action"][0]) for i in items] in ([3, 4, 5], [2, 3, 4, 5])  # each once, none lost
        for item in items:
            want = make_item(int(item["action"][0]), 4, 4)
            assert all(np.array_equal(item[k], want[k]) for k in want)
    finally:
        writer.close()
        first.stop()
        if second is not None:
            second.stop()


def test_a_table_that_grows_under_a_remote_writer_gets_its_rows_in_the_new_segment():
    """Two ways a remote writer's rows meet a table that moved to a new layout: the commit waited on the
    rate limiter while it grew (the commit comes back with the new layout: the kept rows are sent again
    and committed there), and the rows themselves arrive after the growth (refused as for another layout,
    the commit brings the new layout, the same)."""
    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1e12, max_diff=2.0)
    d = start(pb.TableConfig(name="t", max_size=64, sampler=pb.SelectorOptions(fifo=True),
                             remover=pb.SelectorOptions(fifo=True), rate_limiter=limiter))
    try:
        table = d.tables["t"]
        for seed in (1, 2):
            insert(table, seed, length=4, dim=4)
        writer = SlotWriter(grpc.insecure_channel(d.address()), reserve_ahead=4, stream_host="localhost")
        try:
            assert writer.fits("t", SPECS, [4, 4, 4], STRUCTURE_BYTES) and writer._sender is not None
            item = make_item(3, 4, 4)
            writer.write("t", 3, 1.0, [[item["action"]], [item["obs"]], [item["reward"]]], [4, 4, 4])
            time.sleep(0.3)  # rows in, the commit waits on the rate limiter
            version = table.layout().version
            table.grow(table.capacity + 16)
            assert table.layout().version == version + 1
            table.release(table.sample(1).lease_id)  # lets the insert in
            assert writer.wait(0, deadline=time.monotonic() + 30) and writer.error is None
            assert table.size() == 3
            # the writer still holds layout version + 1 and reserved slots; the table grows again first
            table.grow(table.capacity + 16)
            for _ in range(2):
                table.release(table.sample(1).lease_id)
            item = make_item(4, 4, 4)
            writer.write("t", 4, 1.0, [[item["action"]], [item["obs"]], [item["reward"]]], [4, 4, 4])
            assert writer.wait(0, deadline=time.monotonic() + 30) and writer.error is None
        finally:
            writer.close()
        assert table.size() == 4
        items = items_in_insert_order(table)
        for seed, got in zip((3, 4), items[-2:], strict=True):
            want = make_item(seed, 4, 4)
            assert all(np.array_equal(got[k], want[k]) for k in want), seed
        assert _wait(lambda: d.ingest.plane.outstanding() == 0) and slots_accounted(table)
    finally:
        d.stop()


def test_a_remote_slot_writer_gathers_commits_and_reuses_its_row_buffers(monkeypatch):
    """Items written back to back commit in far fewer messages than items (commits gathered while rows are
    on their way), each item's pieces (one of them a strided view) land byte-exact, and the rows the writer
    keeps for resends live in reused buffers (bounded), not one fresh array per item."""
    monkeypatch.setenv("GEAR_HOST_ID", REMOTE["GEAR_HOST_ID"])
    d = start(table_config("t", 128))
    channel = grpc.insecure_channel(d.address())
    w = None
    try:
        for seed in range(1, 3):  # the table learns its layout over InsertStream
            insert(d.tables["t"], seed, length=4, dim=4)
        w = SlotWriter(channel, reserve_ahead=32, stream_host="localhost")
        assert w.fits("t", SPECS, [4, 4, 4], STRUCTURE_BYTES)
        sent = []
        send = w._send

        def counting(request, kind, payload):
            sent.append((kind, len(request.commit.items) if kind == "commit" else 0))
            send(request, kind, payload)

        monkeypatch.setattr(w, "_send", counting)
        n = 96
        for seed in range(100, 100 + n):
            item = make_item(seed, 4, 4)
            wide = np.repeat(item["obs"], 2, axis=1)[:, ::2]  # the same values as a strided view
            w.write("t", seed, 1.0, [[item["action"][:1], item["action"][1:]], [wide[:3], wide[3:]],
                                     [item["reward"]]], [4, 4, 4])
        assert w.wait(0, deadline=time.monotonic() + 30)
        commits = [count for kind, count in sent if kind == "commit"]
        assert sum(commits) == n and len(commits) <= n // 8, commits
        assert w._sender.buffers.kept_bytes <= w._sender.buffers.max_bytes
        # reused: as many buffers as items were in flight at once (up to 64 when idle, more on a loaded
        # machine where commits lag), never one per item (test_row_buffers_are_reused_and_bounded: exactly)
        assert 0 < len(w._sender.buffers._free) < n
        items = items_in_insert_order(d.tables["t"])[-n:]
        for seed, got in zip(range(100, 100 + n), items, strict=True):
            want = make_item(seed, 4, 4)
            assert all(np.array_equal(got[k], want[k]) for k in want), seed
    finally:
        if w is not None:
            w.close()
        channel.close()
        d.stop()


def test_row_buffers_are_reused_and_bounded():
    from gear_contract.stream_rows import RowBuffers

    buffers = RowBuffers(max_bytes=1 << 20)
    a = buffers.take(300_000)
    buffers.give(a)
    assert buffers.take(290_000) is a  # reused for an item of up to its size
    buffers.give(a)
    assert buffers.take(100_000) is not a  # not for one much smaller (it would pin twice the memory)
    for _ in range(8):
        buffers.give(np.empty(300_000, np.uint8))
    assert buffers.kept_bytes <= 1 << 20  # the oldest dropped past the bound


def test_a_table_that_moves_between_a_writes_check_and_its_open_gets_the_rows_resent(monkeypatch):
    """The table grows (its segment file renamed for the new layout) after a WRITE passed its check and
    before the daemon opened the file: the WRITE is answered LAYOUT_GONE, the connection stays, and the
    writer's rows reach the new segment intact, with no broken pipe at the writer."""
    from gear_server.data_planes import stream_server

    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1e12, max_diff=1e12)
    d = start(pb.TableConfig(name="t", max_size=64, sampler=pb.SelectorOptions(fifo=True),
                             remover=pb.SelectorOptions(fifo=True), rate_limiter=limiter))
    try:
        table = d.tables["t"]
        insert(table, 1, length=4, dim=4)
        original = stream_server.StreamServer._write_target
        moved_from: list[int] = []

        def racing(self, grant, name, layout):
            if not moved_from:
                moved_from.append(layout.version)
                table.grow(table.capacity + 16)  # between the WRITE's check and the open of its file
            return original(self, grant, name, layout)

        monkeypatch.setattr(stream_server.StreamServer, "_write_target", racing)
        writer = SlotWriter(grpc.insecure_channel(d.address()), reserve_ahead=4, stream_host="localhost")
        try:
            assert writer.fits("t", SPECS, [4, 4, 4], STRUCTURE_BYTES) and writer._sender is not None
            item = make_item(2, 4, 4)
            writer.write("t", 2, 1.0, [[item["action"]], [item["obs"]], [item["reward"]]], [4, 4, 4])
            assert writer.wait(0, deadline=time.monotonic() + 30) and writer.error is None, writer.error
        finally:
            writer.close()
        assert moved_from and table.layout().version > moved_from[0]
        assert table.size() == 2
        got, want = items_in_insert_order(table)[-1], make_item(2, 4, 4)
        assert all(np.array_equal(got[k], want[k]) for k in want)
        assert _wait(lambda: d.ingest.plane.outstanding() == 0) and slots_accounted(table)
    finally:
        d.stop()
