"""Token, TLS and mutual TLS on a real daemon process; data-plane handles only for authenticated calls."""

from __future__ import annotations

import os
import stat
import uuid

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import gear_client
from gear_client import errors
from gear_client.connection.auth import ChannelSecurity
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.ops import health
from tests.support.daemon_process import DaemonProcess
from tests.support.echo_server import call_method, replay_methods
from tests.support.tables_toml import drain_queue, insert_items, tables_toml

TOKEN = "daemon-test-token-0123456789"


def _token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def _open_plane(channel, metadata=None) -> pb.OpenDataPlaneResponse:
    offer = pb.DataPlaneOffer(shm=True, host_id="", inline=True)
    stub = pb_grpc.ReplayServiceStub(channel)
    return stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="queue", offer=offer), timeout=10, metadata=metadata)


def test_every_rpc_needs_the_token_and_handles_go_only_to_authenticated_calls(tmp_path):
    config = tables_toml(f"ops{uuid.uuid4().hex[:8]}") + f'\n[auth]\ntoken_file = "{_token_file(tmp_path)}"\n'
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.wait_ready()
        with grpc.insecure_channel(daemon.address) as channel:
            for method in replay_methods():
                assert call_method(channel, method) == grpc.StatusCode.UNAUTHENTICATED, method
                wrong = [("authorization", "Bearer not-the-token")]
                assert call_method(channel, method, metadata=wrong) == grpc.StatusCode.UNAUTHENTICATED, method
            with pytest.raises(grpc.RpcError) as info:
                _open_plane(channel)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "segment" not in (info.value.details() or "")
            # Reflection needs the token too; health answers probes without one.
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            check = health.health_pb2_grpc.HealthStub(channel).Check
            assert check(health.health_pb2.HealthCheckRequest(), timeout=10).status == health.SERVING
            # Per-service names need the token (the same answer for a service that exists and one that does not).
            for service in (health.REPLAY_SERVICE, "no.such.Service"):
                with pytest.raises(grpc.RpcError) as info:
                    check(health.health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = check(health.health_pb2.HealthCheckRequest(service=health.REPLAY_SERVICE), timeout=10,
                          metadata=[("authorization", f"Bearer {TOKEN}")])
            assert reply.status == health.SERVING

        # The Reverb API with the token: everything works.
        client = gear_client.Client(daemon.address, token=TOKEN, data_planes=())
        insert_items(client, range(3))
        assert drain_queue(client, 2) == [0, 1]
        with pytest.raises(errors.ServiceError) as info:
            gear_client.Client(daemon.address, data_planes=()).server_info(timeout=10)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

        # An authenticated learner gets the segment, which only the daemon's user can open.
        with ChannelSecurity.build(token=TOKEN, use_env=False).channel(daemon.address) as channel:
            response = _open_plane(channel)
        assert response.layout.segment, response
        mode = stat.S_IMODE(os.stat(response.layout.segment).st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        assert daemon.stop() == 0


def test_mutual_tls_with_a_token(tmp_path, pki, monkeypatch):
    config = tables_toml(f"ops{uuid.uuid4().hex[:8]}") + f'''
[auth]
token_file = "{_token_file(tmp_path)}"
tls_cert_file = "{pki / 'server.crt'}"
tls_key_file = "{pki / 'server.key'}"
tls_client_ca_file = "{pki / 'ca.crt'}"
'''
    daemon = DaemonProcess(tmp_path, config)
    try:
        port = daemon.wait_ready()
        target = f"localhost:{port}"
        client = gear_client.Client(target, token=TOKEN, root_certificates=str(pki / "ca.crt"),
                                    certificate_chain=str(pki / "client.crt"), private_key=str(pki / "client.key"),
                                    data_planes=())
        insert_items(client, range(2))
        assert client.server_info(timeout=10)["queue"].current_size == 2

        # The same through the environment, for Reverb code that passes only an address.
        monkeypatch.setenv("GEAR_TOKEN", TOKEN)
        monkeypatch.setenv("GEAR_TLS_ROOT_CERTS", str(pki / "ca.crt"))
        monkeypatch.setenv("GEAR_TLS_CERT_CHAIN", str(pki / "client.crt"))
        monkeypatch.setenv("GEAR_TLS_PRIVATE_KEY", str(pki / "client.key"))
        assert drain_queue(gear_client.Client(target, data_planes=()), 2) == [0, 1]
        monkeypatch.delenv("GEAR_TLS_CERT_CHAIN")
        monkeypatch.delenv("GEAR_TLS_PRIVATE_KEY")

        for security in (ChannelSecurity.build(token=TOKEN, root_certificates=str(pki / "ca.crt"), use_env=False),
                         ChannelSecurity.build(token=TOKEN, root_certificates=str(pki / "ca.crt"),
                                               certificate_chain=str(pki / "rogue.crt"),
                                               private_key=str(pki / "rogue.key"), use_env=False)):
            with security.channel(target) as channel:  # no client certificate, or one of another CA
                assert call_method(channel, "ServerInfo") == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(target) as channel:
            assert call_method(channel, "ServerInfo") == grpc.StatusCode.UNAVAILABLE
    finally:
        assert daemon.stop() == 0
    assert "security: token, mutual TLS" in daemon.log
