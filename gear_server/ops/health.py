"""The standard gRPC health service and server reflection, from grpcio-health-checking / grpcio-reflection.

Probes (grpc_health_probe, Kubernetes gRPC probes, load balancers) call
``Health.Check``; tools (grpcurl, grpcui) list services and fetch descriptors
through reflection (``grpc.reflection.v1alpha``, the version the library serves;
grpcurl falls back to it). The daemon marks itself SERVING only after its tables
are restored and NOT_SERVING as soon as it starts to stop.

Without the token (when one is configured, docs/SECURITY.md), health answers
only the server's overall status (service ``""``): per-service names need the
token, so an outside caller learns nothing about what the daemon serves.
Watch streams are asyncio tasks (no thread each) and count against
``limits.max_health_streams``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from grpc import aio
from grpc_health.v1 import health as _health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from gear_server.ops.auth import TokenCheck

__all__ = ["HEALTH_SERVICE", "NOT_SERVING", "REFLECTION_SERVICE", "REPLAY_SERVICE", "SERVICE_UNKNOWN", "SERVING",
           "Health", "add_to_server", "health_pb2", "health_pb2_grpc", "reflection_pb2"]

REPLAY_SERVICE = "gear.v1.ReplayService"
HEALTH_SERVICE = _health.SERVICE_NAME
REFLECTION_SERVICE = reflection.SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class _Servicer(_health.aio.HealthServicer):
    """The library's servicer; per-service names need the token when one is configured."""

    def __init__(self, services: Sequence[str], token: TokenCheck | None) -> None:
        super().__init__()
        self._token = token
        # Known services start NOT_SERVING (the library starts the server SERVING).
        self._server_status.update(dict.fromkeys(["", *services], NOT_SERVING))

    async def _gate(self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext) -> None:
        if request.service and self._token is not None and \
                not self._token.authenticated(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "per-service health needs the bearer token; service \"\" answers the server's status")

    async def Check(self, request, context):  # noqa: N802 (gRPC method name)
        await self._gate(request, context)
        return await super().Check(request, context)

    async def Watch(self, request, context):  # noqa: N802
        await self._gate(request, context)
        return await super().Watch(request, context)


class Health:
    """Serving status of the daemon's services; thread-safe setters for the daemon's lifecycle."""

    def __init__(self, servicer: _Servicer, loop: asyncio.AbstractEventLoop, services: Sequence[str]) -> None:
        self.servicer = servicer
        self._loop = loop
        self._services = ["", *services]

    def _run(self, coroutine) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._loop.create_task(coroutine)
        elif self._loop.is_closed():
            coroutine.close()
        else:
            asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    def set_all(self, status: int) -> None:
        """Every service, the server (``""``) included, to ``status``."""
        async def apply() -> None:
            for service in self._services:
                await self.servicer.set(service, status)

        self._run(apply())

    def set(self, service: str, status: int) -> None:
        self._run(self.servicer.set(service, status))

    def status(self, service: str = "") -> int:
        return self.servicer._server_status.get(service, SERVICE_UNKNOWN)

    def shutdown(self) -> None:
        """NOT_SERVING everywhere, for good (the server is going away)."""
        self._run(self.servicer.enter_graceful_shutdown())


def add_to_server(server: aio.Server, services: Sequence[str], token: TokenCheck | None = None) -> Health:
    """Register health (every service NOT_SERVING until set) and reflection; call on the server's loop.

    ``services`` are the fully-qualified names of the application services
    (``gear.v1.ReplayService``); health and reflection add themselves.
    """
    servicer = _Servicer(services, token)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*services, HEALTH_SERVICE, REFLECTION_SERVICE], server)
    return Health(servicer, asyncio.get_running_loop(), services)
