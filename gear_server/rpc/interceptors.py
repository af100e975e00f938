"""The daemon's grpc.aio server interceptors: call limits, request parsing, RPC accounting.

``wrap_handler`` puts code around any method handler, whatever its shape
(unary or streaming request, answer returned, yielded or written), so each
interceptor states only what it adds:

* ``CallGuard``: every call takes a slot of its pool (health calls, which may
  come without a token, have their own) and gets RESOURCE_EXHAUSTED at once,
  naming the limit's config key, when the pool is full; request bytes that do not
  parse as the method's message end the call with INVALID_ARGUMENT (no
  traceback; the first few a minute are logged) in every service, the library
  ones (health, reflection) included.
* ``RpcObserver``: counts every finished call by method and status code, with
  its duration (``ServerMetrics.observe_rpc``), and hands failures to ``on_error``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from gear_server.ops.metrics import UNKNOWN_METHOD, ServerMetrics, method_label
from gear_server.rpc.limits import CallSlots, LimitSettings
from gear_server.rpc.statuses import LimitExceeded, RefusalLog

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"

def wrap_handler(handler: grpc.RpcMethodHandler, *, enter: Callable[[aio.ServicerContext], Awaitable[None]],
                 leave: Callable[[aio.ServicerContext, BaseException | None], None],
                 deserializer: Callable[[bytes], Any] | None = None,
                 requests: Callable[[Any, aio.ServicerContext], Any] | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with ``enter(context)`` before it runs and ``leave(context, error)`` after it ended.

    ``leave`` runs only when ``enter`` returned (an ``enter`` that aborts the call skips it).
    ``deserializer`` replaces the handler's; ``requests(request_or_iterator, context)``
    may replace what the behaviour receives (its result is awaited when awaitable: a
    coroutine that aborts the call refuses it).
    """
    inner = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)

    if inspect.isasyncgenfunction(inner):
        async def behavior(request, context):  # answers yielded
            await enter(context)
            error = None
            try:
                if requests is not None:
                    request = requests(request, context)
                    if inspect.isawaitable(request):
                        request = await request
                async for response in inner(request, context):
                    yield response
            except BaseException as e:
                error = e
                raise
            finally:
                leave(context, error)
    else:
        async def behavior(request, context):  # answer returned (or written with context.write)
            await enter(context)
            error = None
            try:
                if requests is not None:
                    request = requests(request, context)
                    if inspect.isawaitable(request):
                        request = await request
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result
            except BaseException as e:
                error = e
                raise
            finally:
                leave(context, error)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        behavior, request_deserializer=deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer)


class _Cache:
    """Wrapped handlers by the handler they wrap (one per method): built once, bounded."""

    def __init__(self) -> None:
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(self, handler: grpc.RpcMethodHandler, build: Callable[[], grpc.RpcMethodHandler]
            ) -> grpc.RpcMethodHandler:
        entry = self._wrapped.get(id(handler))
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = build()
        if len(self._wrapped) > 4096:  # handlers made per call (not ours): keep the cache bounded
            self._wrapped.clear()
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped


# ------------------------------------------------------------------ request parsing

class MalformedRequest:
    """Request bytes that do not parse as the method's message (the call ends INVALID_ARGUMENT)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error

    def __str__(self) -> str:
        return f"not a valid request message ({self.error})"


def lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """A deserializer that hands unparsable bytes on as MalformedRequest (instead of INTERNAL + traceback)."""
    def parse(data: bytes) -> Any:
        if deserializer is None:
            return data
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 (protobuf raises DecodeError, or others on odd input)
            return MalformedRequest(e)

    return parse


async def _refuse(method: str, request: MalformedRequest, context: aio.ServicerContext,
                  refusals: RefusalLog) -> None:
    refusals.info("%s: refused bytes that are %s", method, request)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))


async def _checked_stream(method: str, requests: AsyncIterator[Any], context: aio.ServicerContext,
                          refusals: RefusalLog) -> AsyncIterator[Any]:
    n = 0
    async for request in requests:
        if isinstance(request, MalformedRequest):
            refusals.info("%s: refused request %d, bytes that are %s", method, n, request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {n}: {request}")
        n += 1
        yield request


class CallGuard(aio.ServerInterceptor):
    """Call limits per pool and INVALID_ARGUMENT for unparsable requests (see the module docstring)."""

    def __init__(self, limits: LimitSettings):
        self.calls = CallSlots(limits.max_streams, "limits.max_streams", "calls")
        self.health_calls = CallSlots(limits.max_health_streams, "limits.max_health_streams", "health calls")
        self._refusals = RefusalLog(log)
        self._cache = _Cache()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return self._cache.get(handler, lambda: self._wrap(handler, method))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        slots = self.health_calls if method.startswith(HEALTH_PREFIX) else self.calls
        refusals = self._refusals

        async def enter(context: aio.ServicerContext) -> None:
            try:
                slots.take()
            except LimitExceeded as e:  # refused: leave() does not run, the call took no slot
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

        def leave(context: aio.ServicerContext, error: BaseException | None) -> None:
            slots.give()

        if handler.request_streaming:
            def requests(iterator: Any, context: aio.ServicerContext) -> Any:
                return _checked_stream(method, iterator, context, refusals)
        else:
            def requests(request: Any, context: aio.ServicerContext) -> Any:
                if isinstance(request, MalformedRequest):  # awaited by the wrapper: the call ends there
                    return _refuse(method, request, context, refusals)
                return request
        return wrap_handler(handler, enter=enter, leave=leave, deserializer=lenient(handler.request_deserializer),
                            requests=requests)


# ------------------------------------------------------------------ accounting

class RpcObserver(aio.ServerInterceptor):
    """Counts every finished RPC by method and status code, with its duration (and hands errors to ``on_error``).

    Placed first among the server's interceptors so it also sees calls the
    token check refused. Labels are bounded by ``ServerMetrics.observe_rpc``
    (callers choose method names: unknown ones count as one label).
    """

    def __init__(self, metrics: ServerMetrics | None, on_error: Callable[[str, str], None] | None = None) -> None:
        self._metrics = metrics
        self._on_error = on_error
        self._cache = _Cache()

    def _finish(self, method: str, context: aio.ServicerContext, error: BaseException | None, started: float) -> None:
        if isinstance(error, asyncio.CancelledError):
            name = "CANCELLED"
        else:
            code = context.code()
            if isinstance(code, grpc.StatusCode):
                name = code.name
            elif isinstance(code, int):
                name = next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
            else:
                name = "OK" if error is None else "UNKNOWN"
        if self._metrics is not None:
            self._metrics.observe_rpc(method, name, time.perf_counter() - started)
        if name != "OK" and self._on_error is not None:
            self._on_error(method_label(method), name)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if method_label(method) == UNKNOWN_METHOD:  # names callers make up are not worth a cache entry
            return self._wrap(handler, method)
        return self._cache.get(handler, lambda: self._wrap(handler, method))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        started: dict[int, float] = {}

        async def enter(context: aio.ServicerContext) -> None:
            started[id(context)] = time.perf_counter()

        def leave(context: aio.ServicerContext, error: BaseException | None) -> None:
            self._finish(method, context, error, started.pop(id(context), time.perf_counter()))

        return wrap_handler(handler, enter=enter, leave=leave)
