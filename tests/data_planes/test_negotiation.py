"""Negotiation: the rules, and OpenDataPlane / Select / Release / CloseDataPlane on a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gear_client.data_planes.sampler import PlaneSampler
from gear_client.data_planes.session import parse_select
from gear_contract import negotiation as neg
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.rdma_emulation import EmulatedRdmaServer, emulated_port
from tests.support.trajectories import fill

ROOT = Path(__file__).resolve().parents[2]
RPC_S = 10


def offer(**kwargs) -> pb.DataPlaneOffer:
    return pb.DataPlaneOffer(**kwargs)


def test_the_daemon_picks_the_best_common_plane():
    rdma = emulated_port().endpoint([0x10], [1])
    assert neg.choose_plane(offer(shm=True, host_id="h", inline=True), "h", False) == neg.SHM
    assert neg.choose_plane(offer(shm=True, host_id="x", rdma=rdma, inline=True), "h", True) == neg.RDMA
    assert neg.choose_plane(offer(shm=True, host_id="x", rdma=rdma, inline=True), "h", False) == neg.INLINE
    assert neg.choose_plane(offer(shm=True, host_id="", inline=True), "", False) == neg.INLINE  # no identity
    with pytest.raises(neg.NoCommonPlaneError, match="shm needs the learner on the daemon's host"):
        neg.choose_plane(offer(shm=True, host_id="x"), "h", False)
    with pytest.raises(neg.NoCommonPlaneError, match="no RDMA device"):
        neg.choose_plane(offer(rdma=rdma), "h", False)


def test_the_device_plane_needs_the_offer_the_host_and_a_mirrored_table():
    wants = offer(shm=True, device=True, host_id="h", inline=True)
    assert neg.choose_plane(wants, "h", False, table_mirrored=True) == neg.DEVICE
    assert neg.choose_plane(wants, "h", False, table_mirrored=False) == neg.SHM
    assert neg.choose_plane(offer(shm=True, host_id="h"), "h", False, table_mirrored=True) == neg.SHM
    assert neg.choose_plane(offer(device=True, host_id="x", inline=True), "h", False, table_mirrored=True) == neg.INLINE
    assert neg.build_offer(["device", "shm"], "h", None, device=True).device
    assert not neg.build_offer(["shm"], "h", None, device=True).device  # not allowed
    assert not neg.build_offer(["device", "shm"], "h", None).device  # no GPU to read it with


def test_nixl_ranks_below_shm_and_rdma_and_above_stream():
    rdma = emulated_port().endpoint([0x10], [1])
    every = offer(shm=True, host_id="x", rdma=rdma, nixl=True, stream=True, inline=True)
    both = {"daemon_has_stream": True, "daemon_has_nixl": True}
    assert neg.choose_plane(offer(shm=True, host_id="h", nixl=True), "h", False, **both) == neg.SHM
    assert neg.choose_plane(every, "h", True, **both) == neg.RDMA
    assert neg.choose_plane(every, "h", False, **both) == neg.NIXL
    assert neg.choose_plane(every, "h", False, daemon_has_stream=True) == neg.STREAM  # the daemon has no NIXL agent
    assert neg.choose_plane(offer(nixl=True, inline=True), "h", False) == neg.INLINE
    with pytest.raises(neg.NoCommonPlaneError, match="the daemon has no NIXL agent"):
        neg.choose_plane(offer(nixl=True), "h", False, daemon_has_stream=True)
    assert neg.build_offer(["nixl", "inline"], "x", None).nixl
    assert not neg.build_offer(["stream", "inline"], "x", None).nixl


def test_plane_lists_are_checked_and_kept_best_first():
    assert neg.normalise_planes(None) == neg.PLANES
    assert neg.normalise_planes(["inline", "SHM"]) == ("shm", "inline")
    assert neg.normalise_planes("rdma") == ("rdma",)
    with pytest.raises(ValueError, match="unknown data plane"):
        neg.normalise_planes(["shm", "carrier pigeon"])
    with pytest.raises(ValueError, match="at least one"):
        neg.normalise_planes([])


def test_host_identity_is_stable_and_can_be_pinned(monkeypatch):
    monkeypatch.delenv(neg.ENV_HOST_ID, raising=False)
    first = neg.local_host_id()
    assert first == neg.local_host_id() and len(first) == 32
    monkeypatch.setenv(neg.ENV_HOST_ID, "rack7-node3")
    assert neg.local_host_id() == "rack7-node3"


def test_offer_only_carries_allowed_and_available_planes():
    rdma = emulated_port().endpoint([0x10], [1])
    o = neg.build_offer(["rdma", "inline"], "h", rdma)
    assert not o.shm and o.inline and o.HasField("rdma") and o.host_id == "h"
    assert not neg.build_offer(["shm", "rdma"], "h", None).HasField("rdma")


@pytest.fixture
def daemon():
    d = start_daemon(table_config("t", 32), table_config("empty", 8))
    fill(d.tables["t"], 20, length=16, dim=8)
    yield d
    d.stop()


@pytest.fixture
def stub(daemon):
    channel = grpc.insecure_channel(daemon.address())
    yield pb_grpc.ReplayServiceStub(channel)
    channel.close()


def open_plane(stub, table: str = "t", **offer_kwargs) -> pb.OpenDataPlaneResponse:
    return stub.OpenDataPlane(pb.OpenDataPlaneRequest(table=table, offer=offer(**offer_kwargs)), timeout=RPC_S)


def test_same_host_learner_gets_shm_with_the_segment_layout(daemon, stub):
    resp = open_plane(stub, shm=True, host_id=daemon.host_id, inline=True)
    assert resp.kind == "shm" and resp.session_id
    layout = daemon.tables["t"].layout()
    assert resp.layout.segment == layout.segment and resp.layout.version == layout.version
    assert os.path.exists(resp.layout.segment) and resp.lease_timeout_ms > 0


def test_remote_learner_without_common_rdma_gets_inline_and_no_session(daemon, stub):
    resp = open_plane(stub, shm=True, host_id="another-host", rdma=emulated_port().endpoint([0x10], [1]),
                      inline=True)
    assert resp.kind == "inline" and resp.session_id == ""
    assert len(daemon.manager.sessions) == 0


def test_refusals_carry_the_right_status_and_the_daemon_keeps_serving(daemon, stub):
    with pytest.raises(grpc.RpcError) as err:
        open_plane(stub, shm=True, host_id="another-host")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no data plane in common" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        open_plane(stub, table="nope", inline=True)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Select(pb.SelectRequest(session_id="deadbeef", num_samples=1), timeout=RPC_S)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    session = open_plane(stub, shm=True, host_id=daemon.host_id).session_id
    for n in (0, -3, 1 << 40):
        with pytest.raises(grpc.RpcError) as err:
            stub.Select(pb.SelectRequest(session_id=session, num_samples=n), timeout=RPC_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    resp = stub.Select(pb.SelectRequest(session_id=session, num_samples=4), timeout=RPC_S)
    assert len(parse_select(resp, None)) == 4


def test_select_returns_references_and_leases_until_release(daemon, stub):
    table = daemon.tables["t"]
    session = open_plane(stub, shm=True, host_id=daemon.host_id).session_id
    resp = stub.Select(pb.SelectRequest(session_id=session, num_samples=5), timeout=RPC_S)
    meta = table.meta
    selected = parse_select(resp, None)  # the packed arrays: the only form the daemon answers
    assert len(selected) == 5
    for slot, generation, lengths, key in zip(selected.slots, selected.generations, selected.lengths,
                                              selected.infos[0], strict=True):
        assert meta.key[slot] == key and meta.generation[slot] == generation
        assert list(lengths) == [16, 16, 16]
    assert not resp.HasField("layout")  # the session already holds this layout
    assert table.active_leases() == 1
    rel = stub.Release(pb.ReleaseRequest(session_id=session, lease_ids=[resp.lease_id]), timeout=RPC_S)
    assert list(rel.stale_lease_ids) == [] and table.active_leases() == 0
    rel = stub.Release(pb.ReleaseRequest(session_id=session, lease_ids=[resp.lease_id]), timeout=RPC_S)
    assert list(rel.stale_lease_ids) == [resp.lease_id]  # released twice: cannot vouch for it


def test_closing_a_session_releases_its_leases_and_ends_a_blocked_select(daemon, stub):
    session = open_plane(stub, table="empty", shm=True, host_id=daemon.host_id).session_id
    blocked = stub.Select.future(pb.SelectRequest(session_id=session, num_samples=1), timeout=RPC_S)
    with pytest.raises(grpc.FutureTimeoutError):
        blocked.result(timeout=0.3)  # empty table: waits on the rate limiter
    stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=session), timeout=RPC_S)
    with pytest.raises(grpc.RpcError) as err:
        blocked.result(timeout=5)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=session), timeout=RPC_S)  # twice is fine
    assert len(daemon.manager.sessions) == 0


def test_first_select_of_an_empty_table_brings_the_layout(daemon, stub):
    resp = open_plane(stub, table="empty", shm=True, host_id=daemon.host_id)
    assert resp.kind == "shm" and not resp.HasField("layout")
    fill(daemon.tables["empty"], 2, length=4, dim=8)
    sel = stub.Select(pb.SelectRequest(session_id=resp.session_id, num_samples=1), timeout=RPC_S)
    assert sel.HasField("layout") and sel.layout.segment == daemon.tables["empty"].layout().segment
    sel = stub.Select(pb.SelectRequest(session_id=resp.session_id, num_samples=1), timeout=RPC_S)
    assert not sel.HasField("layout")


def test_rdma_is_negotiated_when_both_sides_have_a_device():
    rdma = EmulatedRdmaServer()
    d = start_daemon(table_config("t", 8), rdma=rdma)
    try:
        fill(d.tables["t"], 3, length=4, dim=8)
        channel = grpc.insecure_channel(d.address())
        stub = pb_grpc.ReplayServiceStub(channel)
        learner = emulated_port().endpoint([0x21, 0x22, 0x23], [4, 5, 6])
        resp = open_plane(stub, shm=True, host_id="elsewhere", rdma=learner, inline=True)
        assert resp.kind == "rdma" and len(resp.rdma.qp_nums) == 3
        assert resp.region.length == d.tables["t"].layout().segment_size and resp.region.rkey
        bad = emulated_port().endpoint([0x21, 0x22], [4])
        with pytest.raises(grpc.RpcError) as err:
            open_plane(stub, host_id="elsewhere", rdma=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "PSN" in err.value.details()
        stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=resp.session_id), timeout=RPC_S)
        assert rdma.closed_sessions == 1  # queue pairs torn down with the session
        channel.close()
    finally:
        d.stop()


_LEARNER = """
import json, sys
from gear_client.data_planes.sampler import PlaneSampler
from tests.support.trajectories import check_batch
s = PlaneSampler(sys.argv[1], "t")
batch = s.sample(6)
print(json.dumps({"kind": s.kind, "plane": batch.plane, "items": check_batch(batch), "excluded": sorted(s._excluded)}))
s.close()
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare(1)")
def test_a_learner_that_cannot_open_the_segment_falls_back_to_inline(daemon):
    """Same host identity, but its own /dev/shm (like a container): shm is chosen, fails, inline follows."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GEAR_HOST_ID=daemon.host_id)
    script = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c '{_LEARNER}' {daemon.address()}"
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                         text=True, timeout=60, env=env, cwd=ROOT)
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"kind": "inline", "plane": "inline", "items": 6, "excluded": ["shm"]}


def test_sampler_on_the_daemons_host_uses_shm_and_gets_intact_items(daemon):
    from tests.support.trajectories import check_batch

    with PlaneSampler(daemon.address(), "t") as s:
        batch = s.sample(12)
        assert s.kind == "shm" and batch.plane == "shm"
        assert check_batch(batch) == 12
        assert batch.columns[1].shape == (12, 16, 8)
