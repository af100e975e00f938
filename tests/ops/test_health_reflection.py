"""The standard health service and server reflection, called by real gRPC clients."""

from __future__ import annotations

import threading

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from gear_server import health

from ._support import start_server


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


def test_watch_streams_changes_and_ends_at_shutdown(served):
    servicer, channel = served
    stub = health.health_pb2_grpc.HealthStub(channel)
    stream = stub.Watch(health.health_pb2.HealthCheckRequest(service=""), timeout=20)
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(r.status for r in stream))
    reader.start()
    for _ in range(100):
        if seen:
            break
        threading.Event().wait(0.02)
    servicer.set("", health.SERVING)
    for _ in range(100):
        if len(seen) >= 2:
            break
        threading.Event().wait(0.02)
    servicer.shutdown()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert seen == [health.NOT_SERVING, health.SERVING, health.NOT_SERVING]


@pytest.mark.parametrize("package", sorted(health.REFLECTION))
def test_reflection_lists_services_and_serves_descriptors(served, package):
    _, channel = served
    pb2, pb2_grpc = health.REFLECTION[package]
    stub = pb2_grpc.ServerReflectionStub(channel)
    requests = [
        pb2.ServerReflectionRequest(list_services=""),
        pb2.ServerReflectionRequest(file_containing_symbol=health.REPLAY_SERVICE),
        pb2.ServerReflectionRequest(file_containing_symbol="gear.v1.NoSuchThing"),
        pb2.ServerReflectionRequest(file_by_filename="gear/v1/replay.proto"),
    ]
    listed, by_symbol, missing, by_name = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {health.REPLAY_SERVICE, health.HEALTH_SERVICE, f"{package}.ServerReflection"} <= names

    # The descriptors are enough to rebuild the service and its messages in a fresh pool.
    pool = descriptor_pool.DescriptorPool()
    for blob in by_symbol.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(blob))
    service = pool.FindServiceByName(health.REPLAY_SERVICE)
    assert "Sample" in service.methods_by_name and "OpenDataPlane" in service.methods_by_name
    assert pool.FindMessageTypeByName("gear.v1.SampleRequest").fields_by_name["num_samples"].number == 2

    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "gear.v1.NoSuchThing" in missing.error_response.error_message
    # Asked by name, the file comes again (dependencies already sent on this stream are not repeated).
    protos = [descriptor_pb2.FileDescriptorProto.FromString(b)
              for b in by_name.file_descriptor_response.file_descriptor_proto]
    assert [p.name for p in protos] == ["gear/v1/replay.proto"]
