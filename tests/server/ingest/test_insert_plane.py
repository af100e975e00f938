"""The insert plane on loopback with real processes and real shared memory.

Actors are separate processes writing with the ordinary TrajectoryWriter (or the
insert plane's SlotWriter where a test needs to stop between reserve and
commit); items are the checksummed trajectories of the data-plane tests
(``action[0]`` = seed, ``action[1]`` = CRC32 of obs and reward).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from gear_contract._proto import replay_pb2 as pb
from gear_contract.negotiation import local_host_id
from gear_contract.slot_writer import INSERT_PLANE_METHOD, SlotWriter
from tests.support.insert_plane import finish, intact, items_in_insert_order, run_actor, slots_accounted, start
from tests.support.metrics_text import parse, value
from tests.support.paths import ROOT
from tests.support.plane_daemon import table_config
from tests.support.ports import free_port
from tests.support.trajectories import STRUCTURE, insert, item_ok, make_item

# Reserves slots, half-writes garbage into them, then waits to be killed.
RESERVER = """
import sys, time
import grpc, numpy as np
from gear_contract.slot_writer import SlotWriter
from gear_contract import nest
w = SlotWriter(grpc.insecure_channel(sys.argv[1]), reserve_ahead=8)
specs = [(np.dtype(np.int64), (), False), (np.dtype(np.float32), (4,), False), (np.dtype(np.float32), (), False)]
structure = nest.structure_of({"obs": 0, "action": 0, "reward": 0}).SerializeToString()
while not w.fits("t", specs, [4, 4, 4], structure):
    time.sleep(0.01)
while len(w._tables["t"].pool) < 8:
    time.sleep(0.01)
mapping = w._tables["t"].mapping
for slot, _ in w._tables["t"].pool:
    mapping.views[1][slot, :2] = 7.0  # a partial write
print("RESERVED", len(w._tables["t"].pool), flush=True)
time.sleep(120)
"""


def test_an_actor_process_writes_through_the_insert_plane_and_the_items_read_back_byte_exact():
    d = start(table_config("t", 64))
    try:
        result = run_actor(d.address(), 1000, 30, 8, 64)
        assert result["insert_plane"]
        table = d.tables["t"]
        assert table.size() == 30
        # the first item fixed the layout over InsertStream; once the writer knows it, items go through the plane
        assert d.ingest.plane.items_committed >= 25
        items = items_in_insert_order(table)
        for seed, item in zip(range(1000, 1030), items, strict=True):  # in the order the actor wrote them
            want = make_item(seed, 8, 64)
            for name in ("action", "obs", "reward"):
                assert np.array_equal(item[name], want[name]), (seed, name)
        assert d.tables["t"].info().num_episodes == 30
        metrics = parse(d.ops.metrics.render().decode())  # plane inserts are counted like InsertStream's
        assert value(metrics, "gear_inserts_total", table="t") == 30
        assert value(metrics, "gear_bytes_received_total", table="t") == 30 * 8 * (8 + 64 * 4 + 4)
        with PlaneSampler(d.address(), "t") as learner:
            assert intact(learner.sample(16)) == 16
        deadline = time.monotonic() + 5
        while d.ingest.plane.outstanding() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.ingest.plane.outstanding() == 0 and table.slot_counts().reserved == 0 and slots_accounted(table)
    finally:
        d.stop()


def test_an_actor_killed_between_reserve_and_commit_leaves_nothing_visible_and_no_slot_leaked():
    d = start(table_config("t", 32, spare=16))
    try:
        table = d.tables["t"]
        for seed in range(1, 5):
            insert(table, seed, length=4, dim=4)
        capacity = table.capacity
        actor = subprocess.Popen([sys.executable, "-c", RESERVER, d.address()], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            line = actor.stdout.readline()
            assert line.startswith("RESERVED"), actor.stderr.read() if actor.poll() is not None else line
            assert d.ingest.plane.outstanding() == 8 and table.slot_counts().reserved == 8
            assert table.size() == 4  # reserved slots are invisible
        finally:
            actor.send_signal(signal.SIGKILL)
            actor.wait(10)
        deadline = time.monotonic() + 10
        while (d.ingest.plane.outstanding() or table.slot_counts().reserved) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.ingest.plane.outstanding() == 0 and table.slot_counts().reserved == 0
        assert table.size() == 4 and slots_accounted(table)
        assert all(item_ok(i["action"], i["obs"], i["reward"]) for i in items_in_insert_order(table))
        for seed in range(5, 5 + 60):  # the slots are usable: the table fills and evicts without growing
            insert(table, seed, length=4, dim=4)
        assert table.size() == 32 and table.capacity == capacity and slots_accounted(table)
    finally:
        d.stop()


def test_reservations_of_a_live_but_stalled_writer_time_out():
    d = start(table_config("t", 32), reservation_timeout_s=0.5)
    try:
        insert(d.tables["t"], 1, length=4, dim=4)
        writer = SlotWriter(grpc.insecure_channel(d.address()), reserve_ahead=4)
        try:
            specs = [(np.dtype(np.int64), (), False), (np.dtype(np.float32), (4,), False),
                     (np.dtype(np.float32), (), False)]
            structure = STRUCTURE.SerializeToString()
            deadline = time.monotonic() + 5
            while not writer.fits("t", specs, [4, 4, 4], structure) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.ingest.plane.outstanding() == 4
            deadline = time.monotonic() + 5
            while d.ingest.plane.outstanding() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert d.ingest.plane.outstanding() == 0 and d.tables["t"].slot_counts().reserved == 0
            # the writer never uses a reservation past half the timeout: it asks for new ones
            item = make_item(7, 4, 4)
            writer.write("t", 7, 1.0, [[item["action"]], [item["obs"]], [item["reward"]]], [4, 4, 4])
            writer.wait(0)
            assert writer.error is None and d.tables["t"].size() == 2
        finally:
            writer.close()
    finally:
        d.stop()


def test_concurrent_same_host_actors_and_a_learner_see_no_torn_item():
    """Three actor processes fill a 16-item table (every slot rewritten many times) while a learner
    gathers over shm and checks every item's checksum."""
    d = start(table_config("t", 16))
    try:
        insert(d.tables["t"], 1, length=64, dim=1024)
        actors = [run_actor(d.address(), 10_000 * (a + 1), 60, 64, 1024, wait=False) for a in range(3)]
        items = 0
        with PlaneSampler(d.address(), "t") as learner:
            while any(a.poll() is None for a in actors) or items < 64:
                items += intact(learner.sample(8))
        results = [finish(a) for a in actors]
        assert all(r["insert_plane"] for r in results)
        assert d.ingest.plane.items_committed >= 3 * 59
        assert items >= 64 and slots_accounted(d.tables["t"])
    finally:
        d.stop()


def test_a_table_that_grows_while_rows_wait_for_their_commit_gets_them_in_the_new_segment():
    """The commit waits on the rate limiter while the table moves to a new segment: the writer copies
    the rows it wrote into the old one over and commits again."""
    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1e12, max_diff=2.0)
    d = start(pb.TableConfig(name="t", max_size=64, sampler=pb.SelectorOptions(fifo=True),
                             remover=pb.SelectorOptions(fifo=True), rate_limiter=limiter))
    try:
        table = d.tables["t"]
        for seed in (1, 2):
            insert(table, seed, length=4, dim=4)
        assert not table.can_insert(1)
        writer = SlotWriter(grpc.insecure_channel(d.address()), reserve_ahead=4)
        try:
            specs = [(np.dtype(np.int64), (), False), (np.dtype(np.float32), (4,), False),
                     (np.dtype(np.float32), (), False)]
            while not writer.fits("t", specs, [4, 4, 4], STRUCTURE.SerializeToString()):
                time.sleep(0.01)
            item = make_item(3, 4, 4)
            writer.write("t", 3, 1.0, [[item["action"]], [item["obs"]], [item["reward"]]], [4, 4, 4])
            time.sleep(0.2)  # the commit now waits on the rate limiter
            version = table.layout().version
            table.grow(table.capacity + 16)
            assert table.layout().version == version + 1
            table.release(table.sample(1).lease_id)  # lets the insert in
            assert writer.wait(0, deadline=time.monotonic() + 10) and writer.error is None
        finally:
            writer.close()
        assert table.size() == 3
        last = items_in_insert_order(table)[-1]
        assert all(np.array_equal(last[k], item[k]) for k in item)
    finally:
        d.stop()


def _plane_call(address: str, *requests: pb.InsertPlaneRequest) -> list[pb.InsertPlaneResponse]:
    channel = grpc.insecure_channel(address)
    call = channel.stream_stream(INSERT_PLANE_METHOD, request_serializer=pb.InsertPlaneRequest.SerializeToString,
                                 response_deserializer=pb.InsertPlaneResponse.FromString)
    try:
        return list(call(iter(requests), timeout=10))
    finally:
        channel.close()


def _reserve_then_commit(address: str, opened: pb.InsertPlaneRequest, lengths: list[int]) -> None:
    """One stream: open, reserve a slot, commit an item of ``lengths`` into it."""
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def requests():
        yield opened
        yield pb.InsertPlaneRequest(reserve=pb.ReserveSlots(table="t", count=1))
        reserved = answers.get(timeout=10)
        yield pb.InsertPlaneRequest(commit=pb.CommitSlots(table="t", layout_version=reserved.layout_version, items=[
            pb.CommitItem(key=5, priority=1.0, slot=reserved.slots[0], lengths=lengths)]))

    channel = grpc.insecure_channel(address)
    call = channel.stream_stream(INSERT_PLANE_METHOD, request_serializer=pb.InsertPlaneRequest.SerializeToString,
                                 response_deserializer=pb.InsertPlaneResponse.FromString)
    try:
        for response in call(requests(), timeout=10):
            if response.WhichOneof("kind") == "reserved":
                answers.put(response.reserved)
    finally:
        channel.close()


def test_bad_insert_plane_requests_get_clear_statuses_and_the_daemon_goes_on():
    d = start(table_config("t", 16))
    try:
        insert(d.tables["t"], 1, length=4, dim=4)
        with pytest.raises(grpc.RpcError) as e:
            _plane_call(d.address(), pb.InsertPlaneRequest(open=pb.InsertPlaneOpen(host_id="elsewhere", pid=1)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "host" in e.value.details()
        opened = pb.InsertPlaneRequest(open=pb.InsertPlaneOpen(host_id=local_host_id(), pid=os.getpid()))
        with pytest.raises(grpc.RpcError) as e:
            _plane_call(d.address(), opened, pb.InsertPlaneRequest(commit=pb.CommitSlots(
                table="t", layout_version=0, items=[pb.CommitItem(key=5, priority=1.0, slot=3, lengths=[4, 4, 4])])))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not reserved" in e.value.details()
        request = pb.InsertPlaneRequest(reserve=pb.ReserveSlots(table="nope", count=1))
        answers = _plane_call(d.address(), opened, request)
        assert not answers[1].reserved.slots  # no slots: the item goes over InsertStream, which says NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            _plane_call(d.address(), opened, pb.InsertPlaneRequest(reserve=pb.ReserveSlots(table="t", count=10**6)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_reservations" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a length beyond the slot
            _reserve_then_commit(d.address(), opened, lengths=[4, 99, 4])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside [1, 4]" in e.value.details()
        deadline = time.monotonic() + 5
        while d.ingest.plane.outstanding() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.tables["t"].size() == 1 and slots_accounted(d.tables["t"])
    finally:
        d.stop()


def test_items_a_stopped_daemon_did_not_commit_reach_its_successor_over_insert_stream():
    """The daemon stops while commits wait on its rate limiter: the writer sends those items (read back
    from its mapping of the segment) over InsertStream, which reconnects to the daemon restarted on the
    same port; nothing is lost, nothing twice."""
    port = free_port()
    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1e12, max_diff=2.0)
    first = start(pb.TableConfig(name="t", max_size=64, sampler=pb.SelectorOptions(fifo=True),
                                 remover=pb.SelectorOptions(fifo=True), rate_limiter=limiter), port=port)
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
                writer.flush()  # the first item fixes the table's layout (over InsertStream)
        deadline = time.monotonic() + 10
        while (first.tables["t"].size() < 2 or writer._same_host.in_flight > 3) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.tables["t"].size() == 2 and writer._same_host.in_flight == 3  # held by the rate limiter
        first.stop()
        second = start(table_config("t", 64), port=port)
        writer.flush(timeout_ms=30_000)
        items = items_in_insert_order(second.tables["t"])
        assert [int(i["action"][0]) for i in items] == [3, 4, 5]
        for item in items:
            want = make_item(int(item["action"][0]), 4, 4)
            assert all(np.array_equal(item[k], want[k]) for k in want)
    finally:
        writer.close()
        first.stop()
        if second is not None:
            second.stop()
