"""The rdma plane without hardware: the read scheduler, and the whole plane over an emulated NIC.

Everything but verbs.py runs for real here: negotiation with the daemon's RDMA
server interface, endpoint exchange and validation, range planning, chains with
selective signalling over several queue pairs, completion polling, padding,
Release and stale detection, table growth, fallback and teardown. The emulated
NIC (tests/support/rdma_emulation.py) copies bytes where verbs would DMA them.
"""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.data_planes.range_planning import ReadPlan, chain, spread
from gear_client.data_planes.rdma import RdmaReadError, execute_plan
from gear_client.data_planes.sampler import PlaneSampler
from gear_contract._proto import replay_pb2 as pb
from gear_kernels import Window
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.rdma_emulation import EmulatedConnection, EmulatedRdmaServer
from tests.support.trajectories import check_batch, fill, insert


class Never:
    """A transport whose reads never complete."""

    def __init__(self):
        self.posted = 0

    def post_reads(self, queue, wr_id, ranges, local, remote):
        self.posted += 1

    def poll(self, max_entries=32):
        return []


def plan_of(n_ranges: int, queues: int, chain_length: int) -> ReadPlan:
    ranges = np.stack([np.arange(n_ranges) * 64, np.arange(n_ranges) * 64, np.full(n_ranges, 64)], axis=1)
    chains = chain(spread(ranges, queues), chain_length)
    return ReadPlan(chains, int(ranges[:, 2].sum()), n_ranges)


def test_scheduler_keeps_each_queue_pair_within_its_send_queue():
    conn = EmulatedConnection(num_qps=3)
    src = np.arange(64 * 100, dtype=np.int64).astype(np.uint8)
    from tests.support.rdma_emulation import REG_LOCK, REGISTERED

    with REG_LOCK:
        REGISTERED[(1, 99)] = src
    try:
        local = conn.region_of(conn.allocate(64 * 100))
        plan = plan_of(100, 3, 4)
        done = execute_plan(conn, plan, local, pb.RdmaRegion(addr=1, rkey=99, length=src.nbytes), max_in_flight=2)
    finally:
        with REG_LOCK:
            REGISTERED.pop((1, 99))
    assert done == sum(len(q) for q in plan.chains) == conn.posted_chains
    assert conn.posted_requests == 100 and conn.signalled == done  # one completion per chain, not per read
    assert conn.max_in_flight_seen <= 2
    buf = conn._buffers[local.addr][0]
    assert np.array_equal(buf[:6400], src)


def test_an_error_completion_or_a_stall_raises():
    conn = EmulatedConnection(num_qps=2, fail_after=1)
    local = conn.region_of(conn.allocate(4096))
    with pytest.raises(RdmaReadError, match="completion status 12"):
        execute_plan(conn, plan_of(8, 2, 2), local, pb.RdmaRegion(addr=5, rkey=5, length=1 << 20), max_in_flight=4)
    ticks = iter(range(0, 1000, 10))
    with pytest.raises(RdmaReadError, match="stalled"):
        execute_plan(Never(), plan_of(4, 1, 1), local, pb.RdmaRegion(), max_in_flight=1, timeout_s=25,
                     clock=lambda: next(ticks))


@pytest.fixture
def rdma_daemon():
    server = EmulatedRdmaServer()
    d = start_daemon(table_config("t", 32), rdma=server)
    fill(d.tables["t"], 32, length=64, dim=256)
    yield d, server
    d.stop()


def remote_sampler(d, connections: list, **kwargs) -> PlaneSampler:
    """A learner that is "on another host" (its own host id) with an (emulated) RDMA device."""
    def factory():
        conn = EmulatedConnection(**kwargs)
        connections.append(conn)
        return conn

    return PlaneSampler(d.address(), "t", host_id="learner-on-another-host", rdma_connection=factory)


def test_a_remote_learner_reads_batches_over_rdma(rdma_daemon):
    d, server = rdma_daemon
    conns: list = []
    with remote_sampler(d, conns, num_qps=4) as s:
        batches = [s.sample(16) for _ in range(3)]
        assert s.kind == "rdma" and all(b.plane == "rdma" for b in batches)
        assert sum(check_batch(b) for b in batches) == 48
        conn = conns[0]
        assert list(conn.connected_to.qp_nums) == server.accepted[0].qp_nums  # QP attributes exchanged
        plan = s._plane.last_plan
        assert sum(1 for q in plan.chains if q) == 4  # spread over every queue pair
        assert conn.signalled < conn.posted_requests  # selective signalling
        windowed = s.sample(8, window=Window(10, -10, "head"))
        assert windowed.columns[1].shape == (8, 10, 256) and np.all(windowed.lengths[:, 1] == 10)
        obs = windowed.columns[1]
        ref = d.tables["t"]
        for i, key in enumerate(windowed.keys.tolist()):
            slot = int(np.flatnonzero(ref.meta.key == key)[0])
            stored = ref.layout().column_view(ref.segment.buffer, 1)[slot, 54:64]
            assert np.array_equal(obs[i], stored)
    assert conn.closed and server.closed_sessions == 1 and server.accepted[0].closed


def test_table_growth_moves_rdma_reads_to_the_new_segment_without_reopening():
    server = EmulatedRdmaServer()
    d = start_daemon(table_config("t", 8), rdma=server)
    try:
        fill(d.tables["t"], 4, length=8, dim=16)
        conns: list = []
        with remote_sampler(d, conns, num_qps=2) as s:
            first = s.sample(4)
            region_before = s._plane.region.rkey
            insert(d.tables["t"], 77, length=40, dim=16)  # longer: the table regrows into a new segment
            batch = s.sample(6)
            assert batch.plane == "rdma" and s.reopens == 0 and s._plane.region.rkey != region_before
            assert check_batch(first) == 4 and check_batch(batch) == 6
            assert batch.columns[1].shape[1] == 40
    finally:
        d.stop()


def test_an_rdma_failure_falls_back_to_inline_without_losing_the_batch(rdma_daemon):
    d, server = rdma_daemon
    conns: list = []
    with remote_sampler(d, conns, num_qps=2, fail_after=3) as s:
        batch = s.sample(16)
        assert batch.plane == "inline" and s.kind == "inline" and "rdma" in s._excluded
        assert check_batch(batch) == 16
    assert conns[0].closed and server.closed_sessions == 1
    assert d.tables["t"].active_leases() == 0
