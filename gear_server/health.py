"""The standard gRPC health service (grpc.health.v1) and server reflection (v1 and v1alpha).

Probes (grpc_health_probe, Kubernetes gRPC probes, load balancers) call
``Health.Check``; tools (grpcurl, grpcui) list services and fetch descriptors
through reflection. The daemon marks itself SERVING only after its tables are
restored and NOT_SERVING as soon as it starts to stop.

Message modules: the official ``grpcio-health-checking`` / ``grpcio-reflection``
packages are used when importable, else the modules generated from
protos/grpc/ (tools/gen_protos.py). Both define the same protobuf symbols, so
only one of each may live in a process's default descriptor pool: import the
message modules through this module (``health_pb2``, ``health_pb2_grpc``,
``REFLECTION``), never ``gear_contract._proto.health_pb2`` directly.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

log = logging.getLogger(__name__)

REPLAY_SERVICE = "gear.v1.ReplayService"
HEALTH_SERVICE = "grpc.health.v1.Health"


def _load(official: str, generated: str) -> tuple[ModuleType, ModuleType]:
    """(pb2, pb2_grpc) from the official package when importable, else from gear_contract._proto."""
    try:
        return importlib.import_module(official + "_pb2"), importlib.import_module(official + "_pb2_grpc")
    except Exception:  # absent, or built for another protobuf/grpcio: use ours
        return (importlib.import_module(f"gear_contract._proto.{generated}_pb2"),
                importlib.import_module(f"gear_contract._proto.{generated}_pb2_grpc"))


health_pb2, health_pb2_grpc = _load("grpc_health.v1.health", "health")
# Reflection package -> (pb2, pb2_grpc); both versions are served, clients pick either.
REFLECTION: dict[str, tuple[ModuleType, ModuleType]] = {
    "grpc.reflection.v1": _load("grpc_reflection.v1.reflection", "reflection_v1"),
    "grpc.reflection.v1alpha": _load("grpc_reflection.v1alpha.reflection", "reflection_v1alpha"),
}

ServingStatus = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Per-service serving status; ``""`` is the whole server. Watch streams every change."""

    def __init__(self, services: Iterable[str] = ("",), status: int = NOT_SERVING) -> None:
        self._status = dict.fromkeys(services, status)
        self._status.setdefault("", status)
        self._changed = threading.Condition()
        self._closed = False

    def set(self, service: str, status: int) -> None:
        """Set one service's status (adding it) and wake its watchers."""
        with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    def set_all(self, status: int) -> None:
        """Set every known service, the server included, to ``status``."""
        with self._changed:
            for service in self._status:
                self._status[service] = status
            self._changed.notify_all()

    def status(self, service: str = "") -> int:
        with self._changed:
            return self._status.get(service, SERVICE_UNKNOWN)

    def shutdown(self) -> None:
        """NOT_SERVING everywhere and end open Watch streams (the server is going away)."""
        with self._changed:
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._closed = True
            self._changed.notify_all()

    def Check(self, request, context):  # noqa: N802 (gRPC method name)
        with self._changed:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context):  # noqa: N802
        last = None
        while context.is_active():
            with self._changed:
                current = self._status.get(request.service, SERVICE_UNKNOWN)
                if current == last and not self._closed:
                    # Wake now and then to notice a client that went away.
                    self._changed.wait(timeout=1.0)
                    current = self._status.get(request.service, SERVICE_UNKNOWN)
                closed = self._closed
            if current != last:
                last = current
                yield health_pb2.HealthCheckResponse(status=current)
            if closed:
                return


class ReflectionServicer:
    """ServerReflectionInfo over the process's default descriptor pool, for one protocol version."""

    def __init__(self, service_names: Sequence[str], pb2: ModuleType,
                 pool: descriptor_pool.DescriptorPool | None = None) -> None:
        self._services = sorted(service_names)
        self._pb2 = pb2
        self._pool = pool or descriptor_pool.Default()

    def ServerReflectionInfo(self, request_iterator, context) -> Iterator:  # noqa: N802
        sent: set[str] = set()  # files already sent on this stream (the spec lets us skip them)
        for request in request_iterator:
            yield self._answer(request, sent)

    def _answer(self, request, sent: set[str]):
        pb2 = self._pb2
        response = pb2.ServerReflectionResponse(valid_host=request.host, original_request=request)
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                response.list_services_response.service.extend(
                    pb2.ServiceResponse(name=name) for name in self._services)
            elif kind == "file_by_filename":
                self._files(response, self._pool.FindFileByName(request.file_by_filename), sent)
            elif kind == "file_containing_symbol":
                symbol = request.file_containing_symbol
                self._files(response, self._pool.FindFileContainingSymbol(symbol), sent)
            elif kind == "file_containing_extension":
                ext = request.file_containing_extension
                message = self._pool.FindMessageTypeByName(ext.containing_type)
                field = self._pool.FindExtensionByNumber(message, ext.extension_number)
                self._files(response, field.file, sent)
            elif kind == "all_extension_numbers_of_type":
                message = self._pool.FindMessageTypeByName(request.all_extension_numbers_of_type)
                numbers = sorted(field.number for field in self._pool.FindAllExtensions(message))
                response.all_extension_numbers_response.base_type_name = message.full_name
                response.all_extension_numbers_response.extension_number.extend(numbers)
            else:
                response.error_response.error_code = grpc.StatusCode.UNIMPLEMENTED.value[0]
                response.error_response.error_message = f"unsupported reflection request {kind!r}"
        except KeyError as exc:
            response.ClearField("message_response")
            response.error_response.error_code = grpc.StatusCode.NOT_FOUND.value[0]
            response.error_response.error_message = f"not found: {exc.args[0] if exc.args else exc}"
        return response

    def _files(self, response, file, sent: set[str]) -> None:
        """The file and the dependencies not yet sent, dependencies first."""
        out: list[bytes] = []

        def visit(f) -> None:
            for dep in f.dependencies:
                if dep.name not in sent:
                    sent.add(dep.name)
                    visit(dep)
                    out.append(_serialized(dep))

        visit(file)
        sent.add(file.name)
        out.append(_serialized(file))
        response.file_descriptor_response.file_descriptor_proto.extend(out)


def _serialized(file) -> bytes:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    return proto.SerializeToString()


def add_to_server(server: grpc.Server, services: Sequence[str]) -> HealthServicer:
    """Register health (every service NOT_SERVING until set) and both reflection versions.

    ``services`` are the fully-qualified names of the application services
    (``gear.v1.ReplayService``); health and reflection add themselves.
    """
    health = HealthServicer(services, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*services, HEALTH_SERVICE, *(f"{package}.ServerReflection" for package in REFLECTION)]
    for pb2, pb2_grpc in REFLECTION.values():
        pb2_grpc.add_ServerReflectionServicer_to_server(ReflectionServicer(names, pb2), server)
    return health
