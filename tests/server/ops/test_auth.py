"""Bearer tokens, TLS and mutual TLS on a real loopback gRPC server.

Covers gear_server.ops.auth and gear_client.connection.auth.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from gear_client.connection.auth import ChannelSecurity
from gear_server.ops import health
from gear_server.ops.auth import AuthSettings, BearerTokenInterceptor
from tests.support.echo_server import call_method, replay_methods, start_server

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def token_server():
    denied = []
    interceptors = AuthSettings(token=TOKEN).interceptors(on_denied=denied.append)
    server, port = start_server(interceptors, add=lambda s: health.add_to_server(s, [health.REPLAY_SERVICE]))
    yield port, denied
    server.stop(None)


def test_every_rpc_without_the_token_is_unauthenticated(token_server):
    port, denied = token_server
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for method in replay_methods():
            assert call_method(channel, method) == grpc.StatusCode.UNAUTHENTICATED, method
            for bad in ([("authorization", "Bearer wrong")], [("authorization", TOKEN)],
                        [("authorization", f"bearer {TOKEN}x")]):
                assert call_method(channel, method, metadata=bad) == grpc.StatusCode.UNAUTHENTICATED, (method, bad)
    assert len(denied) == 4 * len(replay_methods())
    assert any(m.endswith("/OpenDataPlane") for m in denied)


def test_every_rpc_with_the_token_reaches_the_service(token_server):
    port, _ = token_server
    security = ChannelSecurity.build(token=TOKEN, use_env=False)
    with security.channel(f"127.0.0.1:{port}") as channel:
        for method in replay_methods():
            assert call_method(channel, method) == grpc.StatusCode.OK, method


def test_health_stays_public_unless_configured(token_server):
    port, _ = token_server
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health.health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health.health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health.NOT_SERVING
    closed = AuthSettings(token=TOKEN, public_health=False)
    server, port = start_server(closed.interceptors(), add=lambda s: health.add_to_server(s, []))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health.health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Check(health.health_pb2.HealthCheckRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(None)


def test_unknown_methods_are_refused_without_a_token(token_server):
    port, _ = token_server
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/gear.v1.ReplayService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            call(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_with_the_right_ca(pki):
    settings = AuthSettings(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"))
    server, port = start_server(credentials=settings.server_credentials())
    try:
        good = ChannelSecurity.build(root_certificates=str(pki / "ca.crt"), use_env=False)
        with good.channel(f"localhost:{port}") as channel:
            assert call_method(channel, "ServerInfo") == grpc.StatusCode.OK
        wrong_ca = ChannelSecurity.build(root_certificates=(pki / "otherca.crt").read_bytes(), use_env=False)
        with wrong_ca.channel(f"localhost:{port}") as channel:
            assert call_method(channel, "ServerInfo") == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"localhost:{port}") as channel:  # plaintext to a TLS port
            assert call_method(channel, "ServerInfo") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki):
    settings = AuthSettings(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"),
                            tls_client_ca_file=str(pki / "ca.crt"), token=TOKEN)
    server, port = start_server(settings.interceptors(), credentials=settings.server_credentials())
    try:
        ca = str(pki / "ca.crt")
        learner = ChannelSecurity.build(root_certificates=ca, certificate_chain=str(pki / "client.crt"),
                                        private_key=str(pki / "client.key"), token=TOKEN, use_env=False)
        with learner.channel(f"localhost:{port}") as channel:
            assert call_method(channel, "OpenDataPlane") == grpc.StatusCode.OK
        no_token = ChannelSecurity.build(root_certificates=ca, certificate_chain=str(pki / "client.crt"),
                                         private_key=str(pki / "client.key"), use_env=False)
        with no_token.channel(f"localhost:{port}") as channel:
            assert call_method(channel, "OpenDataPlane") == grpc.StatusCode.UNAUTHENTICATED
        no_cert = ChannelSecurity.build(root_certificates=ca, token=TOKEN, use_env=False)
        with no_cert.channel(f"localhost:{port}") as channel:
            assert call_method(channel, "OpenDataPlane") == grpc.StatusCode.UNAVAILABLE
        rogue = ChannelSecurity.build(root_certificates=ca, certificate_chain=str(pki / "rogue.crt"),
                                      private_key=str(pki / "rogue.key"), token=TOKEN, use_env=False)
        with rogue.channel(f"localhost:{port}") as channel:
            assert call_method(channel, "OpenDataPlane") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_client_reads_secrets_from_the_environment(tmp_path, pki, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("GEAR_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("GEAR_TLS_ROOT_CERTS", str(pki / "ca.crt"))
    security = ChannelSecurity.build()
    assert security.token == TOKEN and security.tls
    assert security.root_certificates == (pki / "ca.crt").read_bytes()
    assert ChannelSecurity.build(use_env=False) == ChannelSecurity()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="unknown key"):
        AuthSettings.from_toml({"tokn": "x"})
    with pytest.raises(ValueError, match="not both"):
        AuthSettings.from_toml({"token": "x", "token_file": "/etc/gear/token"})
    with pytest.raises(ValueError, match="go together"):
        AuthSettings.from_toml({"tls_cert_file": "/x.crt"})
    with pytest.raises(ValueError, match="mutual TLS"):
        AuthSettings.from_toml({"tls_client_ca_file": "/ca.crt"})
    with pytest.raises(ValueError, match="true or false"):
        AuthSettings.from_toml({"public_health": "yes"})
    with pytest.raises(ValueError, match="token_file /nonexistent"):
        AuthSettings.from_toml({"token_file": "/nonexistent/token"}).load_token()
    with pytest.raises(ValueError, match="empty bearer token"):
        BearerTokenInterceptor("")
    assert AuthSettings.from_toml(None).interceptors() == []
    assert "mutual TLS" in AuthSettings(tls_cert_file="a", tls_key_file="b", tls_client_ca_file="c").describe()


def test_a_token_file_readable_by_others_is_reported(tmp_path, caplog):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="gear_server.ops.auth"):
        assert AuthSettings(token_file=str(token_file)).load_token() == TOKEN
    assert "can be read by other users" in caplog.text
    for private in (0o600, 0o640):  # 0640: group-readable by the daemon's own group (root:gear)
        caplog.clear()
        token_file.chmod(private)
        with caplog.at_level(logging.WARNING, logger="gear_server.ops.auth"):
            AuthSettings(token_file=str(token_file)).load_token()
        assert caplog.text == "", oct(private)
