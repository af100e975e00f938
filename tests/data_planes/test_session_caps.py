"""Limits a caller cannot get around: data-plane sessions per peer, echoed names in error messages."""

from __future__ import annotations

import grpc
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.data_planes.sessions import PER_PEER_KEY, SessionRegistry, peer_identity
from gear_server.data_planes.settings import DataPlaneSettings
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import fill

RPC_S = 10
PER_PEER = 8


@pytest.fixture
def daemon():
    d = start_daemon(table_config("t", 32), bind="[::]",
                     settings=DataPlaneSettings(max_sessions=64, max_sessions_per_peer=PER_PEER))
    fill(d.tables["t"], 8, length=4, dim=8)
    yield d
    d.stop()


def _open(stub, host_id: str) -> pb.OpenDataPlaneResponse:
    offer = pb.DataPlaneOffer(shm=True, host_id=host_id, inline=True)
    return stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="t", offer=offer), timeout=RPC_S)


def test_one_peer_cannot_take_every_session(daemon):
    """Peer 127.0.0.1 fills its share; ::1 (another address) still gets sessions; closing frees them."""
    first = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    second = grpc.insecure_channel(f"[::1]:{daemon.port}")
    try:
        a, b = pb_grpc.ReplayServiceStub(first), pb_grpc.ReplayServiceStub(second)
        opened = [_open(a, daemon.host_id).session_id for _ in range(PER_PEER)]
        assert all(opened) and len(set(opened)) == PER_PEER
        with pytest.raises(grpc.RpcError) as info:
            _open(a, daemon.host_id)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert PER_PEER_KEY in info.value.details()
        assert _open(b, daemon.host_id).kind == "shm"  # the other learner is not pushed to inline
        a.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=opened[0]), timeout=RPC_S)
        assert _open(a, daemon.host_id).session_id  # a closed session frees its place
        held = daemon.manager.sessions.counts_by_peer()
        assert sorted(held.values()) == [1, PER_PEER] and held["ipv4:127.0.0.1"] == PER_PEER, held
    finally:
        first.close()
        second.close()


def test_a_huge_table_name_is_not_found_with_the_name_cut_in_the_message(daemon):
    name = "n" * 10_000
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = pb_grpc.ReplayServiceStub(channel)
        for call in (lambda: stub.MutatePriorities(pb.MutatePrioritiesRequest(table=name), timeout=RPC_S),
                     lambda: stub.OpenDataPlane(pb.OpenDataPlaneRequest(table=name, offer=pb.DataPlaneOffer(
                         inline=True)), timeout=RPC_S),
                     lambda: list(stub.Sample(pb.SampleRequest(table=name, num_samples=1), timeout=RPC_S))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
            details = info.value.details()
            assert "n" * 100 in details and len(details) < 300 and "10000 characters" in details
        assert [t.name for t in stub.ServerInfo(pb.ServerInfoRequest(), timeout=RPC_S).table_info] == ["t"]


def test_registry_counts_sessions_per_peer_through_close_reap_and_close_all():
    now = [0.0]
    registry = SessionRegistry(lease_timeout_s=1, idle_timeout_s=5, max_sessions=10, max_sessions_per_peer=2,
                               clock=lambda: now[0])
    table = object()
    s1 = registry.create(table, "shm", peer="p")
    registry.create(table, "shm", peer="p")
    with pytest.raises(OverflowError, match="max_sessions_per_peer"):
        registry.create(table, "shm", peer="p")
    registry.create(table, "shm", peer="q")
    registry.close(s1.session_id)
    registry.create(table, "shm", peer="p")
    now[0] = 10.0  # every session idle past its timeout
    assert registry.reap() == (0, 3)
    assert registry.counts_by_peer() == {}
    for _ in range(2):
        registry.create(table, "shm", peer="p")
    assert registry.counts_by_peer() == {"p": 2}
    registry.close_all()
    assert registry.counts_by_peer() == {}
    for _ in range(10):
        registry.create(table, "shm", peer=f"r{_}")
    with pytest.raises(OverflowError, match="max_sessions"):
        registry.create(table, "shm", peer="s")


class _Context:
    def __init__(self, peer: str, auth: dict | None = None):
        self._peer, self._auth = peer, auth or {}

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict:
        return self._auth


def test_peer_identity_is_the_certificate_name_or_the_address_without_port():
    assert peer_identity(_Context("ipv4:10.0.0.7:51234")) == "ipv4:10.0.0.7"
    assert peer_identity(_Context("ipv6:[fd00::7]:51234")) == "ipv6:[fd00::7]"
    assert peer_identity(_Context("ipv4:10.0.0.7:1", {"x509_common_name": [b"learner-3"]})) == "cert:learner-3"
    assert peer_identity(_Context("unix:/run/gear.sock")) == "unix:/run/gear.sock"
