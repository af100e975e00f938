"""The standard health service and server reflection, called by real gRPC clients."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gear_server.ops import health
from gear_server.ops.auth import AuthSettings
from gear_server.rpc.interceptors import CallGuard
from gear_server.rpc.limits import LimitSettings
from tests.support.echo_server import start_server


@pytest.fixture
def served():
    box = {}

    def add(server):
        box["health"] = health.add_to_server(server, [health.REPLAY_SERVICE])

    server, port = start_server(add=add)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield box["health"], channel
    channel.close()
    server.stop(None)


def _check(channel, service=""):
    stub = health.health_pb2_grpc.HealthStub(channel)
    return stub.Check(health.health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_check_follows_the_status_the_daemon_sets(served):
    servicer, channel = served
    assert _check(channel) == health.NOT_SERVING
    assert _check(channel, health.REPLAY_SERVICE) == health.NOT_SERVING
    servicer.set_all(health.SERVING)
    assert _check(channel) == health.SERVING
    assert _check(channel, health.REPLAY_SERVICE) == health.SERVING
    with pytest.raises(grpc.RpcError) as info:
        _check(channel, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_streams_changes_up_to_shutdown(served):
    servicer, channel = served
    stub = health.health_pb2_grpc.HealthStub(channel)
    stream = stub.Watch(health.health_pb2.HealthCheckRequest(service=""), timeout=20)
    seen = []

    def read() -> None:
        try:
            seen.extend(r.status for r in stream)
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read)
    reader.start()

    def wait_for(n: int) -> None:
        for _ in range(250):
            if len(seen) >= n:
                return
            threading.Event().wait(0.02)

    wait_for(1)
    servicer.set("", health.SERVING)
    wait_for(2)
    servicer.shutdown()
    wait_for(3)
    stream.cancel()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert seen == [health.NOT_SERVING, health.SERVING, health.NOT_SERVING]


def test_reflection_lists_services_and_serves_descriptors(served):
    _, channel = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=health.REPLAY_SERVICE),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="gear.v1.NoSuchThing"),
        reflection_pb2.ServerReflectionRequest(file_by_filename="gear/v1/replay.proto"),
    ]
    listed, by_symbol, missing, by_name = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {health.REPLAY_SERVICE, health.HEALTH_SERVICE, health.REFLECTION_SERVICE} <= names

    # The descriptors are enough to rebuild the service and its messages in a fresh pool.
    pool = descriptor_pool.DescriptorPool()
    for blob in by_symbol.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(blob))
    service = pool.FindServiceByName(health.REPLAY_SERVICE)
    assert "Sample" in service.methods_by_name and "OpenDataPlane" in service.methods_by_name
    assert pool.FindMessageTypeByName("gear.v1.SampleRequest").fields_by_name["num_samples"].number == 2

    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    protos = [descriptor_pb2.FileDescriptorProto.FromString(b)
              for b in by_name.file_descriptor_response.file_descriptor_proto]
    assert [p.name for p in protos] == ["gear/v1/replay.proto"]


def test_undecodable_bytes_to_health_and_reflection_are_invalid_argument(caplog):
    server, port = start_server([CallGuard(LimitSettings())], add=lambda s: health.add_to_server(s, []))
    garbage = b"\xff\xff\xff\xff\x0f"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, caplog.at_level(logging.INFO):
            for _ in range(20):
                check = channel.unary_unary("/grpc.health.v1.Health/Check")
                with pytest.raises(grpc.RpcError) as info:
                    check(garbage, timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
                with pytest.raises(grpc.RpcError) as info:
                    list(watch(garbage, timeout=10))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                reflect = channel.stream_stream(f"/{health.REFLECTION_SERVICE}/ServerReflectionInfo")
                with pytest.raises(grpc.RpcError) as info:
                    list(reflect(iter([garbage]), timeout=10))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # The server still answers, and it logged no traceback and at most a few lines.
            stub = health.health_pb2_grpc.HealthStub(channel)
            assert stub.Check(health.health_pb2.HealthCheckRequest(), timeout=10).status == health.NOT_SERVING
    finally:
        server.stop(None)
    assert not any(r.exc_info for r in caplog.records)
    assert sum("refused" in r.getMessage() for r in caplog.records) <= 6


def test_without_the_token_health_answers_only_the_servers_status():
    token = "health-token"
    settings = AuthSettings(token=token)
    check = settings.token_check()
    box: dict = {}
    server, port = start_server(settings.interceptors(check=check),
                                add=lambda s: box.update(h=health.add_to_server(s, [health.REPLAY_SERVICE], check)))
    try:
        box["h"].set_all(health.SERVING)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health.health_pb2_grpc.HealthStub(channel)
            assert stub.Check(health.health_pb2.HealthCheckRequest(), timeout=10).status == health.SERVING
            for service in (health.REPLAY_SERVICE, "no.such.Service"):  # the same answer: nothing learned
                for call in (stub.Check, lambda r, timeout: list(stub.Watch(r, timeout=timeout))):
                    with pytest.raises(grpc.RpcError) as info:
                        call(health.health_pb2.HealthCheckRequest(service=service), timeout=10)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = [("authorization", f"Bearer {token}")]
            reply = stub.Check(health.health_pb2.HealthCheckRequest(service=health.REPLAY_SERVICE), timeout=10,
                               metadata=auth)
            assert reply.status == health.SERVING
            with pytest.raises(grpc.RpcError) as info:
                stub.Check(health.health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10, metadata=auth)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(None)
