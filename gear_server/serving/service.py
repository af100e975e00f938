"""The gRPC control plane: ReplayService over the daemon's tables, on the asyncio server.

Every handler runs on the daemon's event loop (grpc.aio); table work goes to
``TableCalls`` (a bounded thread pool) and rate-limiter waits hold no thread,
so thousands of open writer streams and blocked samplers cost memory only.
Every request is validated completely before it touches a table; a request
that is not valid ends its call with INVALID_ARGUMENT (NOT_FOUND for an unknown
table) and the daemon goes on serving. Errors map to statuses in
gear_server/rpc/statuses.py.

Inserts stream: chunks first, then items that reference slices of them; the
next request is read only after the current items are in the table (the rate
limiter holding an insert is the writer's back-pressure, and gRPC's flow
control holds the bytes the writer sends meanwhile). The chunks a stream holds
count against ``[limits]``.

``MutatePriorities`` requests are read by hand (``decode_mutate_priorities``).
Same-host clients may send them, and a learner's Select and Release, over the
local lane (gear_contract/lane_frames.py): the service starts it with the gRPC
server (``GEAR_LOCAL_LANE=0`` turns it off), tells ``ServerInfo`` callers that
ask where it is, and closes it when the server ends.

Samples stream ``SampleResponse``s built by hand (``encode_sample_response``):
the per-column bytes of several items are joined straight from the leased
table slots into the message, so a sampled byte is copied once in Python.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import numpy as np
from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_contract.channel import MAX_MESSAGE_BYTES
from gear_contract.lane_frames import (
    LANE_KEY,
    MUTATE_PRIORITIES,
    RELEASE,
    SELECT,
    advertise,
    decode_priorities,
    lane_enabled,
)
from gear_contract.projection import check_indices, prune_structure
from gear_contract.wire import PriorityUpdates, decode_mutate_priorities, encode_sample_response
from gear_server.data_planes.manager import DataPlaneManager
from gear_server.errors import TableNotFoundError
from gear_server.ops.metrics import ServerMetrics
from gear_server.rpc.insert_requests import SERVICE_NAME, Chunk, build_item, receive_chunks, serialize
from gear_server.rpc.limits import MAX_ITEMS_PER_SAMPLE_REQUEST, ByteBudget, LimitSettings
from gear_server.rpc.statuses import RefusalLog, abort_for, find_table, status_of
from gear_server.rpc.table_calls import CallsInProgress, InlineTableCalls, JoinedSelection, TableCalls
from gear_server.serving.lane_server import LaneContext, LocalLaneServer
from gear_server.table.items import BadRequest, ItemToInsert
from gear_server.table.table import Table

log = logging.getLogger(__name__)

# Bytes of item data per SampleResponse: large enough to amortise per-message
# costs, small enough that producing and consuming messages overlap.
TARGET_SAMPLE_MESSAGE_BYTES = int(os.environ.get("GEAR_SAMPLE_MESSAGE_BYTES", 2 << 20))
MAX_ITEMS_PER_SAMPLE_MESSAGE = 256
# A message the caller sized (max_items_per_message) holds at most this many bytes of items.
MAX_SAMPLE_MESSAGE_BYTES = min(MAX_MESSAGE_BYTES, 64 << 20)


# ------------------------------------------------------------ sample encoding ----

def items_per_message(item_bytes: int, limit: int = MAX_ITEMS_PER_SAMPLE_MESSAGE,
                      target: int = TARGET_SAMPLE_MESSAGE_BYTES) -> int:
    """How many items of ``item_bytes`` bytes go in one SampleResponse (at most ``limit``)."""
    if item_bytes <= 0:
        return limit
    return int(max(1, min(limit, target // item_bytes)))


def _slot_bytes(table: Table) -> int:
    """Bytes one item may take in the table's layout (0 before the first item fixed it)."""
    layout = table.layout()
    if layout is None:
        return 0
    return sum(c.step_bytes * max(1, c.max_length) for c in layout.columns)


# ------------------------------------------------------------ the servicer ----

class ReplayService:
    """The ReplayService RPCs over a dict of tables (register with ``add_to_server``)."""

    def __init__(self, tables: Mapping[str, Table], calls: TableCalls, *, host_id: str = "", version: str = "",
                 checkpoint: Callable[[], str] | None = None, data_planes: DataPlaneManager | None = None,
                 metrics: ServerMetrics | None = None, limits: LimitSettings | None = None,
                 local_lane: bool | None = None):
        """``local_lane``: serve same-host clients' MutatePriorities, Select and Release over the local lane
        too (default: unless ``GEAR_LOCAL_LANE=0``)."""
        self.tables = tables  # the daemon's dict
        self.calls = calls
        self.metrics = metrics
        self.host_id = host_id
        self.version = version
        self.checkpoint_fn = checkpoint
        self.data_planes = data_planes
        self.buffers = ByteBudget(limits or LimitSettings())
        self.refusals = RefusalLog(log)
        # Sample and Select calls in progress: a graceful stop lets them deliver what they took (Daemon.stop).
        self.sampling = CallsInProgress()
        # The ingest workers' ports, as ServerInfo lists them (set by the daemon once they serve).
        self.ingest_ports: Callable[[], list[int]] = list
        self.local_lane: LocalLaneServer | None = None
        self._lane_wanted = lane_enabled() if local_lane is None else local_lane
        self._lane_task: asyncio.Task | None = None

    # -------------------------------------------------------------- inserts
    async def InsertStream(self, request_iterator: AsyncIterator[pb.InsertStreamRequest],  # noqa: N802 (gRPC name)
                           context: aio.ServicerContext) -> AsyncIterator[pb.InsertStreamResponse]:
        chunks: dict[int, Chunk] = {}
        held = self.buffers.stream()
        n = -1
        try:
            async for request in request_iterator:
                n += 1
                try:
                    receive_chunks(request, chunks, held)
                    prepared = []
                    for item in request.items:
                        table = await find_table(self.tables, item.table, context)
                        prepared.append((table, build_item(item, chunks)))
                except BadRequest as e:
                    self.refusals.info("InsertStream request %d refused: %s", n, e)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except Exception as e:  # noqa: BLE001 (a limit: RESOURCE_EXHAUSTED)
                    await abort_for(context, e)
                keys: list[int] = []
                if prepared:
                    error = None
                    try:
                        await self.calls.insert_many(prepared, None, on_inserted=self._acknowledge(keys))
                    except Exception as e:  # noqa: BLE001 (mapped to a status below)
                        error = e
                    if error is not None:
                        if keys:
                            yield pb.InsertStreamResponse(keys=keys)
                        self.refusals.info("InsertStream insert refused: %s", error)
                        await abort_for(context, error)
                for key in request.release_chunk_keys:
                    released = chunks.pop(key, None)
                    if released is not None:
                        held.give(released.nbytes)
                if keys:
                    yield pb.InsertStreamResponse(keys=keys)
        finally:
            held.close()

    def _acknowledge(self, keys: list[int]) -> Callable[[Table, ItemToInsert], None]:
        metrics = self.metrics

        def inserted(table: Table, item: ItemToInsert) -> None:
            keys.append(item.key)
            if metrics is not None:
                metrics.item_inserted(table.name, item.columns)

        return inserted

    # -------------------------------------------------------------- samples
    async def Sample(self, request: pb.SampleRequest,  # noqa: N802
                     context: aio.ServicerContext) -> AsyncIterator[bytes]:
        """Streams serialized SampleResponses (registered with an identity serializer)."""
        table = await find_table(self.tables, request.table, context)
        if request.num_samples < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_samples ({request.num_samples}) must be >= 1")
        if not 0 <= request.max_items_per_message <= MAX_ITEMS_PER_SAMPLE_REQUEST:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"max_items_per_message ({request.max_items_per_message}) must be in "
                                f"[0, {MAX_ITEMS_PER_SAMPLE_REQUEST}] (0: the server's choice)")
        if request.columns:  # refused before anything is picked
            try:
                layout = await self.calls.run(table.layout)
                check_indices(request.columns, len(layout.columns) if layout is not None else 1 << 31)
            except Exception as e:  # noqa: BLE001
                await abort_for(context, e)
        deadline = time.monotonic() + request.timeout_ms / 1000.0 if request.timeout_ms > 0 else None
        with self.sampling.held():
            async for message in self._sample(table, request, deadline, context):
                yield message

    async def _sample(self, table: Table, request: pb.SampleRequest, deadline: float | None,
                      context: aio.ServicerContext) -> AsyncIterator[bytes]:
        """Sample's messages: its items picked as the rate limiter allows, encoded, the leases released."""
        remaining = int(request.num_samples)
        asked = int(request.max_items_per_message)
        while remaining > 0:
            item_bytes = await self.calls.run(_slot_bytes, table)  # reads the layout under the table's lock
            if asked:  # the caller's size, as long as a message stays within MAX_SAMPLE_MESSAGE_BYTES
                per_message = items_per_message(item_bytes, asked, MAX_SAMPLE_MESSAGE_BYTES)
            else:
                per_message = items_per_message(item_bytes)
            want = min(remaining, per_message)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            started = time.perf_counter()
            try:
                selection = await self.calls.sample(table, want, timeout)
            except Exception as e:  # noqa: BLE001
                await abort_for(context, e)
            selected = time.perf_counter()
            messages = await self.calls.run(_encode_and_release, table, selection, list(request.columns))
            if not isinstance(messages, list):
                await abort_for(context, messages)
            remaining -= len(selection)
            if self.metrics is not None:
                self.metrics.sample_served(table.name, len(selection), sum(len(m) for m in messages),
                                           selected - started, time.perf_counter() - selected)
            for message in messages:
                yield message

    # -------------------------------------------------------------- the rest
    def apply_priority_updates(self, request: PriorityUpdates) -> None:
        """A decoded MutatePriorities request applied to its table (TableNotFoundError, ValueError)."""
        table = self.tables.get(request.table)
        if table is None:
            raise TableNotFoundError(request.table)
        table.apply_priority_updates(request.keys, np.asarray(request.priorities, np.float64), request.deletes)

    async def MutatePriorities(self, request: bytes,  # noqa: N802
                               context: aio.ServicerContext) -> bytes:
        """Registered without deserializer and with an empty answer (the request is read by hand)."""
        try:
            await self.calls.run(self.apply_priority_updates, decode_mutate_priorities(request))
        except Exception as e:  # noqa: BLE001
            await abort_for(context, e)
        return b""

    def mutate_priorities_now(self, request: memoryview) -> bytes:
        """The local lane's MutatePriorities, on the lane's thread (which may wait for the table's lock)."""
        self.apply_priority_updates(decode_priorities(request))
        return b""

    async def Reset(self, request: pb.ResetRequest, context: aio.ServicerContext) -> pb.ResetResponse:  # noqa: N802
        table = await find_table(self.tables, request.table, context)
        try:
            await self.calls.run(table.reset)
        except Exception as e:  # noqa: BLE001
            await abort_for(context, e)
        return pb.ResetResponse()

    async def ServerInfo(self, request: pb.ServerInfoRequest,  # noqa: N802
                         context: aio.ServicerContext) -> pb.ServerInfoResponse:
        infos = await self.calls.run(lambda: [t.info() for t in list(self.tables.values())])
        lane = self.local_lane
        if lane is not None and any(key == LANE_KEY for key, _ in context.invocation_metadata() or ()):
            context.set_trailing_metadata(((LANE_KEY, advertise(lane.name, lane.secret)),))
        return pb.ServerInfoResponse(table_info=infos, version=self.version, host_id=self.host_id,
                                     ingest_ports=self.ingest_ports())

    async def CheckRateLimiter(self, request: pb.RateLimiterCheckRequest,  # noqa: N802
                               context: aio.ServicerContext) -> pb.RateLimiterCheckResponse:
        table = await find_table(self.tables, request.table, context)
        if request.num_samples < 0 or request.num_inserts < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_samples and num_inserts must be >= 0")
        samples, inserts = int(request.num_samples), int(request.num_inserts)
        response = pb.RateLimiterCheckResponse()

        def check() -> None:  # takes the table's lock: on the pool, never on the loop
            if samples:
                response.can_sample = table.can_sample(samples)
            if inserts:
                response.can_insert = table.can_insert(inserts)

        await self.calls.run(check)
        return response

    async def Checkpoint(self, request: pb.CheckpointRequest,  # noqa: N802
                         context: aio.ServicerContext) -> pb.CheckpointResponse:
        if self.checkpoint_fn is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon has no checkpoint directory configured")
        try:
            path = await self.calls.run(self.checkpoint_fn)
        except (ValueError, OSError) as e:
            log.warning("checkpoint failed: %s", e)
            await context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {e}")
        return pb.CheckpointResponse(path=path)

    async def _planes(self, context: aio.ServicerContext) -> DataPlaneManager:
        if self.data_planes is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "data planes are not available on this daemon")
        return self.data_planes

    async def OpenDataPlane(self, request: pb.OpenDataPlaneRequest,  # noqa: N802
                            context: aio.ServicerContext) -> pb.OpenDataPlaneResponse:
        response = await (await self._planes(context)).open(request, context)
        if self.metrics is not None:
            self.metrics.plane_opened(response.kind)
        return response

    async def Select(self, request: pb.SelectRequest,  # noqa: N802
                     context: aio.ServicerContext) -> pb.SelectResponse:
        planes = await self._planes(context)
        with self.sampling.held():
            return await planes.select(request, context)

    async def Release(self, request: pb.ReleaseRequest,  # noqa: N802
                      context: aio.ServicerContext) -> pb.ReleaseResponse:
        return await (await self._planes(context)).release(request, context)

    async def CloseDataPlane(self, request: pb.CloseDataPlaneRequest,  # noqa: N802
                             context: aio.ServicerContext) -> pb.CloseDataPlaneResponse:
        return await (await self._planes(context)).close(request, context)

    # -------------------------------------------------------------- registration
    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Handlers for every RPC; Sample sends pre-serialized bytes."""
        def unary(fn: Callable, req: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                       response_serializer=serialize)
        return {
            "InsertStream": grpc.stream_stream_rpc_method_handler(
                self.InsertStream, request_deserializer=pb.InsertStreamRequest.FromString,
                response_serializer=serialize),
            "Sample": grpc.unary_stream_rpc_method_handler(
                self.Sample, request_deserializer=pb.SampleRequest.FromString, response_serializer=_identity),
            "MutatePriorities": grpc.unary_unary_rpc_method_handler(self.MutatePriorities, request_deserializer=None,
                                                                    response_serializer=_identity),
            "Reset": unary(self.Reset, pb.ResetRequest),
            "ServerInfo": unary(self.ServerInfo, pb.ServerInfoRequest),
            "CheckRateLimiter": unary(self.CheckRateLimiter, pb.RateLimiterCheckRequest),
            "Checkpoint": unary(self.Checkpoint, pb.CheckpointRequest),
            "OpenDataPlane": unary(self.OpenDataPlane, pb.OpenDataPlaneRequest),
            "Select": unary(self.Select, pb.SelectRequest),
            "Release": unary(self.Release, pb.ReleaseRequest),
            "CloseDataPlane": unary(self.CloseDataPlane, pb.CloseDataPlaneRequest),
        }

    def add_to_server(self, server: aio.Server) -> None:
        """Register the RPCs; on the server's event loop, also open the local lane until the server ends."""
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, self.method_handlers()),))
        if self._lane_wanted and self.local_lane is None:
            self._open_local_lane(server)

    def _open_local_lane(self, server: aio.Server) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the server's loop: nothing would close the lane with the server
        handlers: dict[int, Any] = {MUTATE_PRIORITIES: self.mutate_priorities_now}
        if self.data_planes is not None:
            handlers.update({SELECT: self._select_on_lane, RELEASE: self._release_on_lane})
        lane = LocalLaneServer(handlers, metrics=self.metrics)
        if lane.start():
            self.local_lane = lane
            self._lane_task = loop.create_task(self._close_lane_after(server))

    async def _select_on_lane(self, request: bytes, context: LaneContext) -> bytes:
        """On the lane connection's own loop: the table work inline, no hop to the daemon's loop or pool;
        the answer serialized as it is built (its arrays copied once)."""
        with self.sampling.held():
            return await self.data_planes.select(_parse(pb.SelectRequest, request), context, _INLINE_CALLS,
                                                 serialized=True)

    async def _release_on_lane(self, request: bytes, context: LaneContext) -> bytes:
        return (await self.data_planes.release(_parse(pb.ReleaseRequest, request), context,
                                               _INLINE_CALLS)).SerializeToString()

    async def _close_lane_after(self, server: aio.Server) -> None:
        try:
            await server.wait_for_termination()
        finally:
            self.close_local_lane(wait_s=0.0)  # on the loop: never wait for calls that need it

    def close_local_lane(self, wait_s: float | None = None) -> None:
        """Stop the local lane (same-host clients go back to gRPC), waiting up to ``wait_s`` (default: the
        lane's) for the calls being answered. Idempotent."""
        lane, self.local_lane = self.local_lane, None
        if lane is not None:
            lane.close() if wait_s is None else lane.close(wait_s)


_INLINE_CALLS = InlineTableCalls()  # the local lane's: each connection thread runs its own loop


def _identity(data: bytes) -> bytes:
    return data


def _parse(message_type: Any, data: bytes) -> Any:
    """``data`` parsed as ``message_type``; ValueError (INVALID_ARGUMENT) when it is not one."""
    try:
        return message_type.FromString(data)
    except Exception as e:  # noqa: BLE001 (protobuf raises DecodeError, or others on odd input)
        raise ValueError(f"not a valid request message ({e})") from None


def _encode_and_release(table: Table, selection: JoinedSelection,
                        columns: list[int] | None = None) -> list[bytes] | BaseException:
    """The serialized SampleResponses of a leased selection, then the lease ends; a table error is returned."""
    try:
        return encode_selection(table, selection, columns)
    except Exception as e:  # noqa: BLE001 (e.g. the table closed under the call)
        if status_of(e) is None:
            raise
        return e
    finally:
        for lease_id in selection.lease_ids:
            table.release(lease_id)


def encode_selection(table: Table, selection: JoinedSelection, columns: list[int] | None = None) -> list[bytes]:
    """The serialized SampleResponses of a leased selection (read while the lease holds): one per run of
    items that share a layout (one in the common case; tables without a signature may hold several).

    ``columns``: only those columns (SampleRequest.columns; ValueError naming one the items lack), the
    structure pruned to them (gear_contract.projection).
    """
    infos = [pb.SampleInfo(key=int(k), probability=float(p), table_size=int(s), priority=float(q),
                           times_sampled=int(t))
             for k, p, s, q, t in zip(selection.keys.tolist(), selection.probabilities.tolist(),
                                      selection.table_sizes.tolist(), selection.priorities.tolist(),
                                      selection.times_sampled.tolist(), strict=True)]
    messages = []
    for group in table.item_groups(selection):
        lengths = np.asarray(group.lengths, dtype=np.int32).reshape(group.stop - group.start, len(group.columns))
        wanted = check_indices(columns, len(group.columns)) if columns else range(len(group.columns))
        structure = prune_structure(group.structure, wanted) if columns else group.structure
        parts = [(group.columns[c][0], group.columns[c][1], group.parts[c]) for c in wanted]
        squeeze = [bool(group.columns[c][2]) for c in wanted]
        messages.append(encode_sample_response(infos[group.start:group.stop], lengths[:, list(wanted)], structure,
                                               squeeze, parts))
    return messages
