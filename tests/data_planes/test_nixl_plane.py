"""The nixl plane on one host: a real daemon's NIXL agent, learners' agents READing over UCX's TCP transport.

The learner allows only nixl and inline, so the daemon answers nixl although it
shares the host; every byte is moved by a NIXL READ over loopback TCP (no RDMA
device here: UCX_TLS=tcp).
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

from gear_contract import negotiation, nixl_agents
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import Churn, check_batch, fill, insert

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(nixl_agents.unavailable_reason() is not None,
                                 reason=f"{nixl_agents.unavailable_reason()} (make test-nixl)")]

PLANES = ["nixl", "inline"]


@pytest.fixture(autouse=True)
def ucx_over_loopback(monkeypatch):
    """UCX's TCP transport on loopback: there is no RDMA device here."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def _sampler(d, **kwargs):
    from gear_client.data_planes.sampler import PlaneSampler

    return PlaneSampler(d.address(), "t", planes=kwargs.pop("planes", PLANES), **kwargs)


def test_a_learner_reads_intact_items_with_one_nixl_read_per_batch_under_churn(monkeypatch):
    from gear_client.data_planes.nixl import NixlPlane

    calls = {"fetch": 0, "read": 0}
    fetch, read = NixlPlane.fetch, NixlPlane.read

    def counted_fetch(self, *args):
        calls["fetch"] += 1
        return fetch(self, *args)

    def counted_read(self, *args):
        calls["read"] += 1
        return read(self, *args)

    monkeypatch.setattr(NixlPlane, "fetch", counted_fetch)
    monkeypatch.setattr(NixlPlane, "read", counted_read)
    d = start_daemon(table_config("t", 32), nixl=True)
    try:
        table = d.tables["t"]
        fill(table, 32, length=32, dim=2048)  # 256 KiB items
        with _sampler(d) as s, Churn(table, length=32, dim=2048) as churn:
            assert s.open() == "nixl"
            checked = batches = 0
            for batch in s.batches(8):
                assert batch.plane == "nixl"
                checked += check_batch(batch)
                batches += 1
                if batches >= 40:
                    break
            assert 0 < calls["read"] <= batches  # a pipelined Select's batches come in one READ, split afterwards
            one_by_one = 0
            for _ in range(10):
                batch = s.sample(8)
                assert batch.plane == "nixl"
                one_by_one += check_batch(batch)
        assert checked == 320 and one_by_one == 80
        assert calls["read"] == calls["fetch"]  # one NIXL transfer a gather, never more
        assert churn.inserted >= 10  # slots were rewritten while the learner read them
        assert d.manager.nixl.segments == ()  # the learner closed its session: every segment let go
    finally:
        d.stop()


def test_a_table_that_grows_is_registered_again_and_the_old_segment_let_go():
    d = start_daemon(table_config("t", 16), nixl=True)
    try:
        table = d.tables["t"]
        fill(table, 16, length=8, dim=64)
        with _sampler(d) as s:
            assert s.open() == "nixl"
            first = table.layout().segment
            assert check_batch(s.sample(4)) == 4 and d.manager.nixl.segments == (first,)
            insert(table, 500, length=64, dim=64)  # longer than any slot holds: a new segment
            assert table.layout().segment != first
            for _ in range(20):
                check_batch(s.sample(4))
            assert s._reader.kind == "nixl"
            assert d.manager.nixl.segments == (table.layout().segment,)
    finally:
        d.stop()


def test_a_missing_or_wrong_session_is_refused_and_a_closed_one_lets_its_segment_go():
    d = start_daemon(table_config("t", 8), nixl=True)
    try:
        fill(d.tables["t"], 8, length=8, dim=64)
        with grpc.insecure_channel(d.address()) as channel:
            stub = pb_grpc.ReplayServiceStub(channel)
            for session_id in ("", "no-such-session"):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Select(pb.SelectRequest(session_id=session_id, num_samples=1))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
            offer = negotiation.build_offer(["nixl"], "another-host", None)
            opened = stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="t", offer=offer))
            assert opened.kind == "nixl" and opened.nixl.agent and opened.nixl.length == opened.layout.segment_size
            assert opened.nixl.agent_metadata and opened.nixl.addr
            assert d.manager.nixl.segments == (opened.layout.segment,)
            stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=opened.session_id))
            assert d.manager.nixl.segments == ()  # no session reads it: deregistered and unmapped
            with pytest.raises(grpc.RpcError) as err:
                stub.Select(pb.SelectRequest(session_id=opened.session_id, num_samples=1))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        d.stop()


def test_bad_descriptors_are_refused_and_the_daemon_keeps_serving():
    from gear_client.data_planes.nixl import NixlReadError
    from gear_client.data_planes.range_planning import LENGTH, LOCAL, REMOTE

    d = start_daemon(table_config("t", 8), nixl=True)
    try:
        fill(d.tables["t"], 8, length=8, dim=64)
        with _sampler(d) as s:
            assert s.open() == "nixl"
            plane = s._reader
            buf = plane._pool.get(1 << 16)
            base = int(buf.ctypes.data)
            size = plane.region.length
            bad = np.zeros((1, 3), dtype=np.int64)
            for remote, length in ((size - 100, 4096), (-4096, 4096), (0, 0)):  # past the end, before it, empty
                bad[0, REMOTE], bad[0, LOCAL], bad[0, LENGTH] = remote, 0, length
                with pytest.raises(NixlReadError, match="outside the daemon's registered segment"):
                    plane.read(bad, base)
            # Past the plane's own check: NIXL itself refuses memory the daemon did not register.
            agent = plane.agent
            local = nixl_agents.descriptors(np.array([base]), np.array([4096]))
            outside = nixl_agents.descriptors(np.array([plane.region.addr + size]), np.array([4096]))
            with pytest.raises(Exception):  # noqa: B017 - the binding's own error type (NIXL_ERR_...)
                agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                      agent.get_xfer_descs(outside, "DRAM"), plane._remote)
            assert check_batch(s.sample(8)) == 8 and s._reader.kind == "nixl"
    finally:
        d.stop()


def test_a_daemon_without_nixl_answers_the_next_plane_and_a_failing_read_falls_back(caplog, monkeypatch):
    d = start_daemon(table_config("t", 8), nixl=None, stream=True)
    try:
        fill(d.tables["t"], 8, length=8, dim=64)
        assert "nixl" not in d.manager.report.offered
        with _sampler(d, planes=["nixl", "stream", "inline"]) as s:
            assert s.open() == "stream"
    finally:
        d.stop()
    d = start_daemon(table_config("t", 8), nixl=True)
    try:
        fill(d.tables["t"], 8, length=8, dim=64)
        from gear_client.data_planes import nixl as nixl_plane

        def broken(self, ranges, local_base):
            raise nixl_plane.NixlReadError("a NIXL READ failed (ERR)")

        monkeypatch.setattr(nixl_plane.NixlPlane, "read", broken)
        with caplog.at_level(logging.WARNING), _sampler(d) as s:
            assert s.open() == "nixl"
            assert check_batch(s.sample(4)) == 4 and s._inline is not None  # the same call, answered inline
        assert any("nixl plane failed while reading (a NIXL READ failed (ERR)); falling back" in r.getMessage()
                   for r in caplog.records)
    finally:
        d.stop()


def test_a_learner_whose_agent_cannot_start_falls_back_and_says_why(caplog, monkeypatch):
    from gear_client.data_planes import nixl as nixl_plane

    def no_agent(role):
        raise nixl_agents.NixlUnavailableError("NIXL agent could not start: NIXL_ERR_BACKEND")

    d = start_daemon(table_config("t", 8), nixl=True, stream=True)
    try:
        fill(d.tables["t"], 8, length=8, dim=64)
        monkeypatch.setattr(nixl_plane.nixl_agents, "new_agent", no_agent)
        with caplog.at_level(logging.INFO), _sampler(d, planes=["nixl", "stream", "inline"]) as s:
            assert s.open() == "stream"
            assert check_batch(s.sample(4)) == 4
        assert any("nixl plane for table 't' unusable (NIXL agent could not start: NIXL_ERR_BACKEND)" in r.getMessage()
                   for r in caplog.records)
        assert d.manager.nixl.segments == ()  # the refused session's registration went with it
    finally:
        d.stop()
