"""The gRPC control plane: ReplayService over the daemon's tables.

Every request is validated completely before it touches a table; a request
that is not valid ends its call with INVALID_ARGUMENT (NOT_FOUND for an unknown
table) and the daemon goes on serving. Errors of the tables map to statuses as
docs/DESIGN.md lists.

Inserts stream: chunks first, then items that reference slices of them; the
next request is read only after the current items are in the table (the rate
limiter holding an insert is the writer's back-pressure).

Samples stream ``SampleResponse``s built by hand (``encode_sample_response``):
the per-column bytes of several items are joined straight from the leased
table slots into the message, so a sampled byte is copied once in Python.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.wire import encode_sample_response
from gear_server.errors import CallCancelled, RateLimiterTimeout, TableClosedError, TableNotFoundError
from gear_server.items import BadRequest, ItemToInsert, tensor_to_array

log = logging.getLogger(__name__)

SERVICE_NAME = "gear.v1.ReplayService"

# Bytes of item data per SampleResponse: large enough to amortise per-message
# costs, small enough that producing and consuming messages overlap (measured
# on loopback: 1-2 MiB per message is best for 256 KiB items).
TARGET_SAMPLE_MESSAGE_BYTES = int(os.environ.get("GEAR_SAMPLE_MESSAGE_BYTES", 2 << 20))
MAX_ITEMS_PER_SAMPLE_MESSAGE = 256
# A segment that cannot be created or grown (full tmpfs, no memory): RESOURCE_EXHAUSTED.
_EXHAUSTED_ERRNOS = frozenset((errno.ENOSPC, errno.ENOMEM, errno.EFBIG))


class _Chunk:
    """A chunk received on an insert stream: its steps as an array."""

    __slots__ = ("array", "episode_id")

    def __init__(self, array: np.ndarray, episode_id: int):
        self.array = array
        self.episode_id = episode_id


def build_item(item: pb.PrioritizedItem, chunks: Mapping[int, _Chunk]) -> ItemToInsert:
    """Build one PrioritizedItem's ItemToInsert from the stream's chunks, validated (gear_server.items)."""
    where = f"item {item.key} for table '{item.table}'"
    columns = []
    squeeze = []
    episodes = set()
    for c, column in enumerate(item.columns):
        if not column.slices:
            raise BadRequest(f"{where}: column {c} is empty")
        parts = []
        for s in column.slices:
            chunk = chunks.get(s.chunk_key)
            if chunk is None:
                raise BadRequest(f"{where}: column {c} references unknown chunk {s.chunk_key}")
            steps = chunk.array.shape[0]
            if s.offset < 0 or s.length < 1 or s.offset + s.length > steps:
                raise BadRequest(f"{where}: column {c} slice [{s.offset}, {s.offset + s.length}) is outside "
                                 f"chunk {s.chunk_key} of {steps} steps")
            parts.append(chunk.array[s.offset:s.offset + s.length])
            episodes.add(chunk.episode_id)
        if column.squeeze:
            if len(parts) != 1 or parts[0].shape[0] != 1:
                raise BadRequest(f"{where}: column {c} is squeezed but spans "
                                 f"{sum(p.shape[0] for p in parts)} steps")
            columns.append(parts[0][0, ...])  # a 0-d array for scalar steps, not a numpy scalar
        else:
            columns.append(parts[0] if len(parts) == 1 else parts)
        squeeze.append(bool(column.squeeze))
    built = ItemToInsert(key=int(item.key), priority=float(item.priority), structure=item.structure,
                         columns=columns, squeeze=squeeze, episode_ids=frozenset(episodes))
    try:
        built.validated()
    except ValueError as e:
        raise BadRequest(f"table '{item.table}': {e}") from None
    return built


# ------------------------------------------------------------ sample encoding ----

def items_per_message(item_bytes: int) -> int:
    """How many items of ``item_bytes`` bytes go in one SampleResponse."""
    if item_bytes <= 0:
        return MAX_ITEMS_PER_SAMPLE_MESSAGE
    return int(max(1, min(MAX_ITEMS_PER_SAMPLE_MESSAGE, TARGET_SAMPLE_MESSAGE_BYTES // item_bytes)))


# ------------------------------------------------------------ the servicer ----

class ReplayService:
    """The ReplayService RPCs over a dict of tables (register with ``add_to_server``)."""

    def __init__(self, tables: Mapping[str, Any], *, host_id: str = "", version: str = "",
                 checkpoint: Callable[[], str] | None = None, data_planes: Any = None, metrics: Any = None):
        self.tables = dict(tables)
        self.metrics = metrics  # gear_server.metrics.ServerMetrics or None
        self.host_id = host_id
        self.version = version
        self.checkpoint_fn = checkpoint
        self.data_planes = data_planes
        self._stopping = threading.Event()

    def stopping(self) -> None:
        """The daemon is stopping: blocked calls give up at their next poll."""
        self._stopping.set()

    # -------------------------------------------------------------- helpers
    def _table(self, name: str, context: grpc.ServicerContext) -> Any:
        table = self.tables.get(name)
        if table is None:
            context.abort(grpc.StatusCode.NOT_FOUND, str(TableNotFoundError(name)))
        return table

    def _abandoned_when_done(self, context: grpc.ServicerContext, tables: Any) -> Callable[[], bool]:
        """A callable that turns true when the RPC ends (cancelled, deadline, client gone).

        The RPC's end wakes the tables' blocked waiters, which then see it and
        give up (CallCancelled) instead of taking an item nobody will receive.
        """
        ended = threading.Event()

        def on_done() -> None:
            ended.set()
            for table in tables:
                table.wake_waiters()

        if not context.add_callback(on_done):
            ended.set()
        return ended.is_set

    @staticmethod
    def _abort_for(error: BaseException, context: grpc.ServicerContext) -> None:
        """End the call with the status that matches a table error."""
        if isinstance(error, TableNotFoundError):
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        if isinstance(error, RateLimiterTimeout):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "rate limiter timeout")
        if isinstance(error, CallCancelled):
            context.abort(grpc.StatusCode.CANCELLED, str(error))
        if isinstance(error, TableClosedError):
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error) or "table closed: the daemon is stopping")
        if isinstance(error, (ValueError, TypeError)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno in _EXHAUSTED_ERRNOS):
            log.warning("out of memory or shared-memory space: %s", error)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the daemon is out of memory: {error}")
        raise error

    # -------------------------------------------------------------- inserts
    def InsertStream(self, request_iterator: Iterator[pb.InsertStreamRequest],  # noqa: N802 (gRPC name)
                     context: grpc.ServicerContext) -> Iterator[pb.InsertStreamResponse]:
        chunks: dict[int, _Chunk] = {}
        abandoned = None
        for n, request in enumerate(request_iterator):
            if isinstance(request, MalformedRequest):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"InsertStream request {n}: {request}")
            try:
                for chunk in request.chunks:
                    chunks[chunk.chunk_key] = _Chunk(
                        tensor_to_array(chunk.data, f"chunk {chunk.chunk_key}", min_rank=1), chunk.episode_id)
                prepared = []
                for item in request.items:
                    table = self.tables.get(item.table)
                    if table is None:
                        context.abort(grpc.StatusCode.NOT_FOUND, str(TableNotFoundError(item.table)))
                    prepared.append((table, build_item(item, chunks)))
            except BadRequest as e:
                log.info("InsertStream request %d refused: %s", n, e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            keys = []
            if prepared and abandoned is None:
                abandoned = self._abandoned_when_done(context, self.tables.values())
            for table, item in prepared:
                try:
                    table.insert(item, timeout=None, abandoned=abandoned)
                except CallCancelled:
                    return
                except Exception as e:  # noqa: BLE001 (mapped to a status below)
                    if keys:
                        yield pb.InsertStreamResponse(keys=keys)
                    log.info("InsertStream insert into '%s' refused: %s", table.name, e)
                    self._abort_for(e, context)
                keys.append(item.key)
                if self.metrics is not None:
                    self.metrics.item_inserted(table.name, item.columns)
            for key in request.release_chunk_keys:
                chunks.pop(key, None)
            if keys:
                yield pb.InsertStreamResponse(keys=keys)

    # -------------------------------------------------------------- samples
    def Sample(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> Iterator[bytes]:  # noqa: N802
        """Streams serialized SampleResponses (registered with an identity serializer)."""
        _check_wellformed(request, context)
        table = self._table(request.table, context)
        if request.num_samples < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_samples ({request.num_samples}) must be >= 1")
        if request.max_items_per_message < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_items_per_message must be >= 0")
        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms > 0 else None
        remaining = int(request.num_samples)
        per_message = int(request.max_items_per_message) or None
        abandoned = self._abandoned_when_done(context, (table,))
        while remaining > 0:
            want = min(remaining, per_message or _guess_items_per_message(table))
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            started = time.perf_counter()
            try:
                selection = table.sample(want, timeout=timeout, abandoned=abandoned)
            except CallCancelled:
                return
            except Exception as e:  # noqa: BLE001
                self._abort_for(e, context)
            selected = time.perf_counter()
            try:
                message = encode_selection(table, selection)
            except Exception as e:  # noqa: BLE001 (e.g. the table closed under the call)
                self._abort_for(e, context)
            finally:
                table.release(selection.lease_id)
            remaining -= len(selection.keys)
            if self.metrics is not None:
                self.metrics.sample_served(table.name, len(selection.keys), len(message), selected - started,
                                           time.perf_counter() - selected)
            yield message

    # -------------------------------------------------------------- the rest
    def MutatePriorities(self, request: pb.MutatePrioritiesRequest,  # noqa: N802
                         context: grpc.ServicerContext) -> pb.MutatePrioritiesResponse:
        table = self._table(request.table, context)
        updates = {}
        for u in request.updates:
            if math.isnan(u.priority) or u.priority < 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"priority of key {u.key} must be a non-negative number, got {u.priority}")
            updates[int(u.key)] = float(u.priority)
        try:
            table.mutate_priorities(updates, [int(k) for k in request.delete_keys])
        except Exception as e:  # noqa: BLE001
            self._abort_for(e, context)
        return pb.MutatePrioritiesResponse()

    def Reset(self, request: pb.ResetRequest, context: grpc.ServicerContext) -> pb.ResetResponse:  # noqa: N802
        table = self._table(request.table, context)
        try:
            table.reset()
        except Exception as e:  # noqa: BLE001
            self._abort_for(e, context)
        return pb.ResetResponse()

    def ServerInfo(self, request: pb.ServerInfoRequest,  # noqa: N802
                   context: grpc.ServicerContext) -> pb.ServerInfoResponse:
        return pb.ServerInfoResponse(table_info=[t.info() for t in self.tables.values()], version=self.version,
                                     host_id=self.host_id)

    def CheckRateLimiter(self, request: pb.RateLimiterCheckRequest,  # noqa: N802
                         context: grpc.ServicerContext) -> pb.RateLimiterCheckResponse:
        table = self._table(request.table, context)
        if request.num_samples < 0 or request.num_inserts < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_samples and num_inserts must be >= 0")
        response = pb.RateLimiterCheckResponse()
        if request.num_samples:
            response.can_sample = table.can_sample(int(request.num_samples))
        if request.num_inserts:
            response.can_insert = table.can_insert(int(request.num_inserts))
        return response

    def Checkpoint(self, request: pb.CheckpointRequest,  # noqa: N802
                   context: grpc.ServicerContext) -> pb.CheckpointResponse:
        if self.checkpoint_fn is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon has no checkpoint directory configured")
        try:
            path = self.checkpoint_fn()
        except (ValueError, OSError) as e:
            log.warning("checkpoint failed: %s", e)
            context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {e}")
        return pb.CheckpointResponse(path=path)

    def _plane(self, name: str, request: Any, context: grpc.ServicerContext) -> Any:
        if self.data_planes is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "data planes are not available on this daemon")
        return getattr(self.data_planes, name)(request, context)

    def OpenDataPlane(self, request, context):  # noqa: N802
        response = self._plane("open", request, context)
        if self.metrics is not None:
            self.metrics.plane_opened(response.kind)
        return response

    def Select(self, request, context):  # noqa: N802
        return self._plane("select", request, context)

    def Release(self, request, context):  # noqa: N802
        return self._plane("release", request, context)

    def CloseDataPlane(self, request, context):  # noqa: N802
        return self._plane("close", request, context)

    # -------------------------------------------------------------- registration
    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Handlers for every RPC; Sample sends pre-serialized bytes."""
        def unary(fn, req):
            def checked(request, context):
                _check_wellformed(request, context)
                return fn(request, context)
            return grpc.unary_unary_rpc_method_handler(
                checked, request_deserializer=_lenient(req), response_serializer=_serialize)
        return {
            "InsertStream": grpc.stream_stream_rpc_method_handler(
                self.InsertStream, request_deserializer=_lenient(pb.InsertStreamRequest),
                response_serializer=_serialize),
            "Sample": grpc.unary_stream_rpc_method_handler(
                self.Sample, request_deserializer=_lenient(pb.SampleRequest), response_serializer=_identity),
            "MutatePriorities": unary(self.MutatePriorities, pb.MutatePrioritiesRequest),
            "Reset": unary(self.Reset, pb.ResetRequest),
            "ServerInfo": unary(self.ServerInfo, pb.ServerInfoRequest),
            "CheckRateLimiter": unary(self.CheckRateLimiter, pb.RateLimiterCheckRequest),
            "Checkpoint": unary(self.Checkpoint, pb.CheckpointRequest),
            "OpenDataPlane": unary(self.OpenDataPlane, pb.OpenDataPlaneRequest),
            "Select": unary(self.Select, pb.SelectRequest),
            "Release": unary(self.Release, pb.ReleaseRequest),
            "CloseDataPlane": unary(self.CloseDataPlane, pb.CloseDataPlaneRequest),
        }

    def add_to_server(self, server: grpc.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, self.method_handlers()),))


class MalformedRequest:
    """Stands for request bytes that do not parse as the RPC's message (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception):
        self.error = error

    def __str__(self) -> str:
        return f"not a valid request message ({self.error})"


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A deserializer that hands unparsable bytes to the handler instead of failing the call as INTERNAL."""
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as e:  # noqa: BLE001 (protobuf raises DecodeError, or others on odd input)
            return MalformedRequest(e)

    return parse


def _check_wellformed(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, MalformedRequest):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))


def _identity(data: bytes) -> bytes:
    return data


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def _guess_items_per_message(table: Any) -> int:
    layout = table.layout()
    if layout is None:
        return MAX_ITEMS_PER_SAMPLE_MESSAGE
    return items_per_message(sum(c.step_bytes * max(1, c.max_length) for c in layout.columns))


def encode_selection(table: Any, selection: Any) -> bytes:
    """The serialized SampleResponse of a leased selection (read while the lease holds)."""
    infos = [pb.SampleInfo(key=int(k), probability=float(p), table_size=int(s), priority=float(q),
                           times_sampled=int(t))
             for k, p, s, q, t in zip(selection.keys.tolist(), selection.probabilities.tolist(),
                                      selection.table_sizes.tolist(), selection.priorities.tolist(),
                                      selection.times_sampled.tolist(), strict=True)]
    lengths = np.asarray(selection.lengths, dtype=np.int32)
    layout = table.layout()
    parts = slot_parts(table, selection)
    columns = []
    squeeze = []
    for c, col in enumerate(layout.columns):
        columns.append((col.dtype, col.shape, parts[c]))
        squeeze.append(bool(col.squeeze))
    structure = layout.structure
    return encode_sample_response(infos, lengths.reshape(len(infos), len(columns)), structure, squeeze, columns)


def slot_parts(table: Any, selection: Any) -> list[list]:
    """Per column, the selected items' bytes: memoryviews of the leased slots when the table exposes them."""
    reader = getattr(table, "slot_views", None)
    if reader is not None:
        return reader(selection)
    return [[np.ascontiguousarray(a)] for a in table.read(selection)]
