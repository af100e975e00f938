"""The InsertPlane RPC: writers on the daemon's host fill table slots themselves; others send them on a stream.

One bidirectional stream per writer. It opens with the writer's host identity
(the daemon refuses writers of another host: they cannot map its segments)
and pid, then carries ``ReserveSlots`` (free slots handed to the writer, with
the layout they address when the writer lacks it), ``CommitSlots`` (items
written into reserved slots, inserted through ``gear_server.ingest.slots``:
the same path as InsertStream's inserts) and ``CancelSlots``. Requests are
answered in order; a commit that waits on the rate limiter holds back the
stream's later requests (the writer's back-pressure).

A writer on another host opens the stream with ``stream`` set: the answer carries
a credential for one of the stream plane's connections (role writer), on which
it sends each reserved slot's rows; the daemon receives them straight into the
segment (``gear_server.data_planes.stream_server``) after checking that the slot
is reserved on this stream, then the writer commits over this stream as usual.

Reservations belong to their stream. They are given back to the table when
one is not committed within the reservation timeout, and when the stream ends:
at once when the writer's process is gone (killed between reserve and
commit), after a short grace otherwise (a writer whose stream broke may still
be finishing a copy into a slot it reserved). Nothing of a reserved slot is
visible until its commit.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_server.errors import CallCancelled, TableNotFoundError
from gear_server.ingest.commit_lane import CommitLane
from gear_server.rpc.insert_requests import SERVICE_NAME
from gear_server.rpc.statuses import LimitExceeded, abort_for
from gear_server.rpc.table_calls import TableCalls
from gear_server.storage import pid_alive
from gear_server.table.items import ReservedItem
from gear_server.table.reserve import LayoutMoved

log = logging.getLogger(__name__)

DEFAULT_RESERVATION_TIMEOUT_S = 60.0
DEFAULT_MAX_RESERVATIONS = 256  # per stream
# A stream that ended while its writer lives: its reservations are given back after this.
END_GRACE_S = 2.0


@dataclass
class _Stream:
    """One writer's InsertPlane stream: the slots it holds and the layouts it has."""

    stream_id: int
    pid: int
    reservations: dict[str, dict[int, float]] = field(default_factory=dict)  # table -> slot -> deadline
    versions: dict[str, int] = field(default_factory=dict)  # table -> layout version the writer has
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False
    # a writer on another host: its row connection's grant, and the slots being received (their deadlines)
    grant: Any = None
    writing: dict[tuple[str, int], float] = field(default_factory=dict)

    def held(self) -> int:
        return sum(len(r) for r in self.reservations.values())


class InsertPlaneManager:
    """Streams and reservations of same-host writers over a daemon's tables."""

    def __init__(self, tables: Mapping[str, Any], host_id: str, calls: TableCalls, *,
                 reservation_timeout_s: float = DEFAULT_RESERVATION_TIMEOUT_S,
                 max_reservations: int = DEFAULT_MAX_RESERVATIONS, end_grace_s: float = END_GRACE_S,
                 reap_interval_s: float | None = None):
        if reservation_timeout_s <= 0 or max_reservations < 1:
            raise ValueError("reservation_timeout_s must be > 0 and max_reservations >= 1")
        self.tables = tables
        self.host_id = host_id
        self.calls = calls
        self.reservation_timeout_s = float(reservation_timeout_s)
        self.max_reservations = int(max_reservations)
        self.end_grace_s = float(end_grace_s)
        self._ids = itertools.count(1)
        self.items_committed = 0  # keys committed over the insert plane (tests, metrics)
        self.metrics: Any = None  # gear_server.ops.metrics.ServerMetrics, set by the daemon
        self.writer_pids: set[int] = set()  # processes that opened a stream (the most recent 1024)
        self.stream: Any = None  # gear_server.data_planes.stream_server.StreamServer: rows of remote writers
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        # table -> its reserves and commits, one pool job at a time (event loop only)
        self.lanes: dict[str, CommitLane] = {}
        self._ending: list[tuple[float, _Stream]] = []  # (give back at, stream)
        self._stop = threading.Event()
        interval = reap_interval_s if reap_interval_s is not None else min(1.0, self.reservation_timeout_s / 4)
        self._reaper = threading.Thread(target=self._reap_loop, args=(interval,), name="gear-insert-plane-reaper",
                                        daemon=True)
        self._reaper.start()

    # ---------------------------------------------------------------- registration
    def add_to_server(self, server: aio.Server) -> None:
        """Register the InsertPlane RPC (beside ReplayService's other RPCs, same service name)."""
        handler = grpc.stream_stream_rpc_method_handler(
            self.handle, request_deserializer=pb.InsertPlaneRequest.FromString,
            response_serializer=pb.InsertPlaneResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"InsertPlane": handler}),))

    # ---------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Stop the reaper and give back every reservation. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._reaper.join(timeout=5)
        with self._lock:
            streams = list(self._streams.values()) + [s for _, s in self._ending]
            self._streams.clear()
            self._ending.clear()
        for stream in streams:
            self._give_back_all(stream)

    def outstanding(self) -> int:
        """Slots reserved by open or ending streams (for tests and metrics)."""
        with self._lock:
            streams = list(self._streams.values()) + [s for _, s in self._ending]
        return sum(s.held() for s in streams)

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                log.exception("insert-plane reaper failed")

    def reap(self, now: float | None = None) -> int:
        """Give back reservations past their timeout and those of streams ended past their grace."""
        now = time.monotonic() if now is None else now
        with self._lock:
            streams = list(self._streams.values())
            due = [s for t, s in self._ending if t <= now]
            self._ending = [(t, s) for t, s in self._ending if t > now]
        count = 0
        for stream in streams:
            with stream.lock:
                for table_name, held in stream.reservations.items():
                    expired = [slot for slot, deadline in held.items() if deadline <= now]
                    if expired:
                        for slot in expired:
                            del held[slot]
                        self._give_back(table_name, expired)
                        count += len(expired)
        for stream in due:
            count += self._give_back_all(stream)
        if count:
            log.info("insert plane: %d reserved slot(s) given back (timed out or writer gone)", count)
        return count

    def _give_back(self, table_name: str, slots: list[int]) -> None:
        table = self.tables.get(table_name)
        if table is not None:
            table.unreserve(slots)

    def _give_back_all(self, stream: _Stream) -> int:
        with stream.lock:  # a slot whose rows are being received goes back when that ends (_end_write)
            held = stream.reservations
            stream.reservations = {table: {slot: d for slot, d in slots.items() if (table, slot) in stream.writing}
                                   for table, slots in held.items()}
            held = {table: [slot for slot in slots if (table, slot) not in stream.writing]
                    for table, slots in held.items()}
        for table_name, slots in held.items():
            if slots:
                self._give_back(table_name, list(slots))
        return sum(len(s) for s in held.values())

    def _end(self, stream: _Stream, clean: bool = False) -> None:
        """The stream ended: give its reservations back now (``clean``: the writer half-closed it after its
        last write; or its process is gone), else after the grace (it may still be copying into a slot)."""
        with self._lock:
            if stream.ended:
                return
            with stream.lock:
                stream.ended = True
            self._streams.pop(stream.stream_id, None)
        if stream.grant is not None and self.stream is not None:
            self.stream.close_session(stream.grant)  # its row connections end
            if not clean and pid_alive(stream.pid) and stream.held():
                self._ending.append((time.monotonic() + self.end_grace_s, stream))
                return
        try:
            self.calls.executor.submit(self._give_back_all, stream)  # off the event loop (table locks)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            self._give_back_all(stream)

    # ---------------------------------------------------------------- the RPC
    async def handle(self, request_iterator: AsyncIterator[pb.InsertPlaneRequest],
                     context: aio.ServicerContext) -> AsyncIterator[pb.InsertPlaneResponse]:
        """The InsertPlane stream (on the daemon's event loop; table work on ``TableCalls``)."""
        stream: _Stream | None = None
        clean = False
        try:
            n = -1
            async for request in request_iterator:
                n += 1
                kind = request.WhichOneof("kind")
                if kind == "open":
                    if stream is not None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "InsertPlane stream opened twice")
                    stream = await self._open(request.open, context)
                    opened = pb.InsertPlaneOpened(reservation_timeout_ms=int(self.reservation_timeout_s * 1000),
                                                  max_reservations=self.max_reservations)
                    if stream.grant is not None:
                        opened.stream.CopyFrom(self.stream.writer_endpoint(stream.grant))
                    yield pb.InsertPlaneResponse(request_id=request.request_id, opened=opened)
                    continue
                if stream is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        "InsertPlane: the first request must be open")
                try:
                    if kind == "reserve":
                        response = pb.InsertPlaneResponse(reserved=await self._reserve(stream, request.reserve))
                    elif kind == "commit":
                        response = pb.InsertPlaneResponse(committed=await self._commit(stream, request.commit))
                    elif kind == "cancel":
                        await self.calls.run(self._cancel, stream, request.cancel)
                        response = pb.InsertPlaneResponse(cancelled=True)
                    else:
                        raise ValueError(f"InsertPlane request {n} is empty")
                except Exception as e:  # noqa: BLE001 (mapped to a status)
                    if not isinstance(e, (ValueError, TableNotFoundError, LimitExceeded)):
                        log.info("InsertPlane %s refused: %s", kind, e)
                    await abort_for(context, e)
                response.request_id = request.request_id
                yield response
            clean = True  # the writer half-closed the stream: it writes nothing more
        finally:
            if stream is not None:
                self._end(stream, clean)

    async def _open(self, request: pb.InsertPlaneOpen, context: aio.ServicerContext) -> _Stream:
        if request.stream and self.stream is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the daemon serves no streams ([data_planes] stream = false); use InsertStream")
        if request.host_id != self.host_id and not request.stream:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the insert plane needs the writer on the daemon's host (host identities differ); "
                                "use InsertStream")
        stream = _Stream(next(self._ids), int(request.pid))
        if request.stream:
            from gear_server.data_planes.stream_server import WriteHooks

            stream.grant = self.stream.grant_writer(WriteHooks(lambda table, slot, version: self._begin_write(
                stream, table, slot, version), lambda table, slot: self._end_write(stream, table, slot)))
        with self._lock:
            self._streams[stream.stream_id] = stream
            if len(self.writer_pids) >= 1024:
                self.writer_pids.clear()
            self.writer_pids.add(stream.pid)
        return stream

    async def _reserve(self, stream: _Stream, request: pb.ReserveSlots) -> pb.SlotsReserved:
        table = self.tables.get(request.table)
        if table is None:  # no slots: the writer's InsertStream reports the unknown table, as without the plane
            return pb.SlotsReserved(table=request.table)
        count = int(request.count)
        if count < 1:
            raise ValueError(f"ReserveSlots count must be >= 1, got {count}")
        with stream.lock:
            held = stream.held()
        if held + count > self.max_reservations:
            raise LimitExceeded(f"ReserveSlots of {count} slots on a stream that holds {held}", self.max_reservations,
                                "[ingest] max_reservations_per_stream")
        slots, layout = await self._lane(table.name).run(table.reserve, count,
                                                         on_orphan=lambda taken: table.unreserve(taken[0]))
        response = pb.SlotsReserved(table=table.name, slots=slots)
        if layout is None:
            return response
        deadline = time.monotonic() + self.reservation_timeout_s
        with stream.lock:
            ended = stream.ended
            if not ended:
                held_here = stream.reservations.setdefault(table.name, {})
                for slot in slots:
                    held_here[slot] = deadline
        if ended:  # the stream ended meanwhile: nobody will write these
            await self.calls.run(table.unreserve, slots)
            raise CallCancelled("the InsertPlane stream ended")
        response.layout_version = layout.version
        if stream.versions.get(table.name) != layout.version:
            response.layout.CopyFrom(layout.to_proto())
            stream.versions[table.name] = layout.version
        return response

    async def _commit(self, stream: _Stream, request: pb.CommitSlots) -> pb.SlotsCommitted:
        table = await _found(self.tables, request.table)
        items = []
        with stream.lock:
            held = stream.reservations.get(table.name, {})
            for item in request.items:
                if item.slot not in held:
                    raise ValueError(f"item {item.key}: slot {item.slot} of table '{table.name}' is not reserved on "
                                     "this stream (never reserved, committed already, or its reservation timed out)")
                if (table.name, item.slot) in stream.writing:
                    raise ValueError(f"item {item.key}: the rows of slot {item.slot} of table '{table.name}' are "
                                     "still being received; commit once they are in")
            for item in request.items:
                held[item.slot] = math.inf  # committing: a rate limiter may hold it past the timeout
                items.append(ReservedItem(int(item.key), float(item.priority), int(item.slot), list(item.lengths),
                                          tuple(item.episode_ids)))
        committed: list[ReservedItem] = []
        moved: TableLayout | None = None
        committer = _Committer(table, int(request.layout_version))
        try:
            await self._lane(table.name).commit([(committer, item) for item in items],
                                                lambda _, item: committed.append(item))
        except LayoutMoved as e:
            moved = e.layout
        with stream.lock:
            held = stream.reservations.get(table.name, {})
            for item in committed:
                held.pop(item.slot, None)
            if moved is not None:  # the rest stay reserved (their rows go into the new segment), timed again
                again = time.monotonic() + self.reservation_timeout_s
                for item in items[len(committed):]:
                    if held.get(item.slot) == math.inf:
                        held[item.slot] = again
        keys = [item.key for item in committed]
        self.items_committed += len(keys)
        if self.metrics is not None and keys:
            step_bytes = [c.step_bytes for c in (moved or table.layout()).columns]
            nbytes = sum(n * b for item in committed for n, b in zip(item.lengths, step_bytes, strict=False))
            self.metrics.items_inserted(table.name, len(keys), nbytes)
        response = pb.SlotsCommitted(table=table.name, keys=keys)
        if moved is not None:
            response.layout.CopyFrom(moved.to_proto())
            stream.versions[table.name] = moved.version
        return response

    def _begin_write(self, stream: _Stream, table_name: str, slot: int, version: int) -> TableLayout:
        """A remote writer's rows for ``slot`` are about to be received: the layout to write them into.

        Refused (``WindowRefused``) unless the slot is reserved on this stream, not being
        committed or written already, and ``version`` is the table's layout now. The slot's
        reservation cannot time out while its rows come in.
        """
        from gear_contract import stream_frames as frames
        from gear_server.data_planes.stream_server import WindowRefused

        table = self.tables.get(table_name)
        if table is None:
            raise WindowRefused(frames.BAD_REQUEST, f"no table '{table_name}'")
        with stream.lock:
            deadline = stream.reservations.get(table_name, {}).get(slot)
            if stream.ended or deadline is None or deadline == math.inf or (table_name, slot) in stream.writing:
                raise WindowRefused(frames.OUT_OF_BOUNDS, f"slot {slot} of table '{table_name}' is not reserved on "
                                                          "this writer's stream (or is being written or committed)")
            stream.writing[(table_name, slot)] = deadline
            stream.reservations[table_name][slot] = math.inf
        layout = table.layout()
        if layout is None or layout.version != version:
            self._end_write(stream, table_name, slot)
            raise WindowRefused(frames.LAYOUT_GONE, f"table '{table_name}' is at layout version "
                                                    f"{None if layout is None else layout.version}, not {version}")
        return layout

    def _end_write(self, stream: _Stream, table_name: str, slot: int) -> None:
        """The rows of ``slot`` are in (or the write failed): its reservation runs again, or goes back
        when the stream ended meanwhile."""
        with stream.lock:
            deadline = stream.writing.pop((table_name, slot), None)
            held = stream.reservations.get(table_name, {})
            if slot in held and held[slot] == math.inf and deadline is not None:
                if stream.ended:
                    del held[slot]
                else:
                    held[slot] = deadline
                    return
            else:
                return
        self._give_back(table_name, [slot])

    def _lane(self, table_name: str) -> CommitLane:
        lane = self.lanes.get(table_name)
        if lane is None:
            lane = self.lanes[table_name] = CommitLane(self.calls)
        return lane

    def _cancel(self, stream: _Stream, request: pb.CancelSlots) -> None:
        table = self.tables.get(request.table)
        if table is None:
            return
        with stream.lock:
            held = stream.reservations.get(table.name, {})
            mine = [int(s) for s in request.slots if held.pop(int(s), None) is not None]
        table.unreserve(mine)


class _Committer:
    """A table as ``TableCalls.insert_many`` sees it, whose inserts commit reserved slots of one layout version."""

    def __init__(self, table: Any, layout_version: int):
        self.table = table
        self.name = table.name
        self.layout_version = layout_version

    def insert(self, item: ReservedItem, timeout: float | None = None, abandoned: Any = None) -> None:
        self.table.commit_reserved(self.layout_version, item, timeout, abandoned)


async def _found(tables: Mapping[str, Any], name: str) -> Any:
    table = tables.get(name)
    if table is None:
        raise TableNotFoundError(name)
    return table
