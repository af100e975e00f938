"""DataPlaneManager: the daemon's handlers for OpenDataPlane, Select, Release and CloseDataPlane.

``ReplayService`` delegates the four RPCs here. ``open`` negotiates the plane
(gear_contract.negotiation) and returns what it needs: the table
layout for shm (the learner maps the segment), the layout plus the daemon's
queue pairs and the segment's memory region for rdma, the layout plus the
daemon's NIXL agent metadata and the registered segment for nixl, nothing for inline (the
learner then samples with the Sample RPC). ``select`` samples like the Sample
RPC but returns item references (slot, generation, lengths) with their
SampleInfo and leases the slots; ``release`` ends leases and says which were
stale. A reaper thread ends leases past their timeout and sessions left idle,
so a learner that dies leaks nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping

import grpc
import numpy as np
from grpc import aio

from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_contract.wire import encode_tensor_fields
from gear_server.data_planes.groups import GroupRegistry, MakerLeft, StepGone, step_rng
from gear_server.data_planes.nixl_server import NixlGrant, NixlServer
from gear_server.data_planes.offers import gpu_off_reason, plane_report
from gear_server.data_planes.rdma_server import RdmaServer
from gear_server.data_planes.sessions import Session, SessionNotFoundError, SessionRegistry, peer_identity
from gear_server.data_planes.settings import DataPlaneSettings
from gear_server.data_planes.stream_server import StreamGrant, StreamServer
from gear_server.errors import NeedsInlinePlane
from gear_server.ops.metrics import ServerMetrics
from gear_server.rpc.statuses import abort_for, find_table
from gear_server.rpc.table_calls import JoinedSelection, TableCalls
from gear_server.table.table import Table

log = logging.getLogger(__name__)

DEFAULT_LEASE_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 600.0
MAX_SELECT = 1 << 20  # items per Select (all its batches together)


class DataPlaneManager:
    """Sessions and leases of learner data planes over a daemon's tables."""

    def __init__(self, tables: Mapping[str, Table], host_id: str, calls: TableCalls, *, rdma: RdmaServer | None = None,
                 rdma_off: str | None = None, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, reap_interval_s: float | None = None,
                 settings: DataPlaneSettings | None = None, stream: StreamServer | None = None,
                 stream_off: str | None = None, nixl: NixlServer | None = None, nixl_off: str | None = None):
        """``rdma``: the daemon's RDMA server (``RdmaServer.open``), or None and ``rdma_off`` saying why;
        ``stream``: the TCP stream plane's server (``open_stream_server``), or None and ``stream_off`` saying why;
        ``nixl``: the nixl plane's agent (``NixlServer.open``), or None and ``nixl_off`` saying why."""
        self.tables = tables  # the daemon's dict: tables added later are seen
        self.host_id = host_id
        settings = settings or DataPlaneSettings()
        self.calls = calls
        self.rdma = rdma
        if rdma is None and rdma_off is None:
            rdma_off = "not attached"
        self.stream = stream
        if stream is None and stream_off is None:
            stream_off = "not attached"
        self.nixl = nixl
        if nixl is None and nixl_off is None:
            nixl_off = "not attached"
        # the daemon logs report.line() at start
        self.report = plane_report(rdma_off, gpu_off_reason(), stream_off, nixl_off)
        self.metrics: ServerMetrics | None = None  # set by the daemon (Operations.attach_data_planes)
        self.sessions = SessionRegistry(lease_timeout_s=lease_timeout_s, idle_timeout_s=idle_timeout_s,
                                        max_sessions=settings.max_sessions,
                                        max_sessions_per_peer=settings.max_sessions_per_peer,
                                        on_close=self._on_session_closed)
        self.groups = GroupRegistry(ttl_s=lease_timeout_s)
        if stream is not None:
            stream.lease_slots = self.sessions.lease_slots
            stream.idle_timeout_s = self.sessions.idle_timeout_s
            stream.retire_after_s = self.sessions.lease_timeout_s
            stream.on_lost = self.sessions.close  # a learner whose connections all went: its leases end now
        # Selects waiting on a rate limiter, by session: a closed session cancels them.
        self._selects: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Task]]] = {}
        self._selects_lock = threading.Lock()
        self._stop = threading.Event()
        interval = reap_interval_s if reap_interval_s is not None else min(1.0, lease_timeout_s / 4)
        self._reaper = threading.Thread(target=self._reap_loop, args=(interval,), name="gear-lease-reaper",
                                        daemon=True)
        self._reaper.start()

    # ---------------------------------------------------------------- lifecycle
    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                expired, idle = self.sessions.reap()
                dropped = self.groups.reap()
                if dropped:
                    log.info("data planes: %d group step(s) not taken by every rank dropped", dropped)
                if expired or idle:
                    log.info("data planes: %d lease(s) expired, %d idle session(s) closed", expired, idle)
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                log.exception("lease reaper failed")

    def shutdown(self) -> None:
        """Stop the reaper, close every session (releasing leases) and the RDMA device. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._reaper.join(timeout=5)
        self.sessions.close_all()
        if self.rdma is not None:
            self.rdma.close()
        if self.stream is not None:
            self.stream.close()
        if self.nixl is not None:
            self.nixl.close()

    def _on_session_closed(self, session: Session) -> None:
        if session.group is not None:
            self.groups.leave(session.group, session.session_id)
        with self._selects_lock:
            waiting = self._selects.pop(session.session_id, ())
        for loop, task in waiting:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # that loop is closed (a lane connection that ended): nothing waits there
                pass
        if isinstance(session.resources, StreamGrant):
            if self.stream is not None:
                self.stream.close_session(session.resources)
        elif isinstance(session.resources, NixlGrant):
            if self.nixl is not None:
                self.nixl.close_session(session.resources)
        elif session.resources is not None and self.rdma is not None:
            try:
                self.rdma.close_session(session.resources)
            except Exception:  # noqa: BLE001 - logged; the session closes anyway
                log.exception("closing RDMA resources of session %s failed", session.session_id)

    # ---------------------------------------------------------------- helpers
    async def _session(self, session_id: str, context: aio.ServicerContext) -> Session:
        try:
            return self.sessions.get(session_id)
        except SessionNotFoundError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def _timeouts(self) -> dict[str, int]:
        return {"lease_timeout_ms": int(self.sessions.lease_timeout_s * 1000),
                "session_idle_timeout_ms": int(self.sessions.idle_timeout_s * 1000)}

    # ---------------------------------------------------------------- RPCs
    async def open(self, request: pb.OpenDataPlaneRequest, context: aio.ServicerContext) -> pb.OpenDataPlaneResponse:
        table = await find_table(self.tables, request.table, context)
        if self._stop.is_set():  # stopping: a session opened now would lose its plane at once
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is stopping")
        try:
            kind = negotiation.choose_plane(request.offer, self.host_id, self.rdma is not None,
                                            table_mirrored=table.mirror is not None,
                                            daemon_has_stream=self.stream is not None,
                                            daemon_has_nixl=self.nixl is not None)
        except negotiation.NoCommonPlaneError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        peer = peer_identity(context)
        try:
            return await self.calls.run(self._open, table, kind, request, peer)
        except OverflowError as exc:  # every session slot is taken
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NeedsInlinePlane as exc:  # items of several layouts, and the learner does not offer inline
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001 - mapped to a status by abort_for
            await abort_for(context, exc)

    def _open(self, table: Table, kind: str, request: pb.OpenDataPlaneRequest, peer: str) -> pb.OpenDataPlaneResponse:
        """Open a session of ``kind`` (on the pool: RDMA resources take device calls)."""
        grouped = request.HasField("group")
        if grouped and (kind == negotiation.INLINE or table.holds_other_layouts()):
            raise NeedsInlinePlane(f"a selection group on table '{table.name}' needs the shm or rdma plane "
                                   f"(this learner was answered {kind}, or the table holds items of several layouts)")
        if kind != negotiation.INLINE and table.holds_other_layouts():  # items outside the segment's layout
            if not request.offer.inline:
                raise NeedsInlinePlane(f"table '{table.name}' holds items of several layouts (no signature); "
                                       "they are read inline only: sample over the Sample RPC")
            return pb.OpenDataPlaneResponse(kind=negotiation.INLINE, **self._timeouts())  # no layout: items differ
        layout = table.layout()
        if kind == negotiation.INLINE:
            response = pb.OpenDataPlaneResponse(kind=kind, **self._timeouts())
            if layout is not None:  # shapes of the padded batches
                response.layout.CopyFrom(layout.to_proto())
            return response
        resources = endpoint = region = None
        if kind == negotiation.RDMA:
            try:
                resources, endpoint = self.rdma.accept(request.offer.rdma)
                if layout is not None:
                    region = self.rdma.attach(resources, layout)
            except ValueError as exc:
                if resources is not None:
                    self.rdma.close_session(resources)
                raise ValueError(f"RDMA endpoint refused: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - the device failed: serve the learner inline
                if resources is not None:
                    self.rdma.close_session(resources)
                log.warning("RDMA connection for table '%s' failed, answering inline: %s", table.name, exc)
                return pb.OpenDataPlaneResponse(kind=negotiation.INLINE, **self._timeouts())
        try:
            session = self.sessions.create(table, kind, resources, peer=peer)
        except OverflowError:
            if resources is not None:
                self.rdma.close_session(resources)
            raise
        if grouped:
            try:
                session.group = self.groups.join(table, request.group, session.session_id)
                session.rank = int(request.group.rank)
            except ValueError:
                self.sessions.close(session.session_id)
                raise
        response = pb.OpenDataPlaneResponse(session_id=session.session_id, kind=kind, **self._timeouts())
        if kind == negotiation.STREAM:
            session.resources = grant = self.stream.grant(session.session_id)
            try:
                layout = self._stream_layout(table, grant, layout)
            except BaseException:
                self.sessions.close(session.session_id)
                raise
            response.stream.CopyFrom(self.stream.endpoint(grant))
        elif kind == negotiation.NIXL:
            session.resources = grant = self.nixl.grant(session.session_id)
            try:
                layout, nixl_region = self._nixl_layout(table, grant, layout)
            except Exception as exc:  # noqa: BLE001 - the agent refused the segment: answer the next plane
                self.sessions.close(session.session_id)
                fallback = negotiation.choose_plane(request.offer, self.host_id, self.rdma is not None,
                                                    daemon_has_stream=self.stream is not None)
                log.warning("nixl: registering table '%s' with the agent failed (%s); answering %s",
                            table.name, exc, fallback)
                return self._open(table, fallback, request, peer)
            if nixl_region is not None:
                response.nixl.CopyFrom(nixl_region)
        if layout is not None:
            session.layout_version = layout.version
            response.layout.CopyFrom(layout.to_proto())
        if kind == negotiation.DEVICE:
            response.device_tier.CopyFrom(table.mirror.describe())
        if endpoint is not None:
            response.rdma.CopyFrom(endpoint)
        if region is not None:
            response.region.CopyFrom(region)
        return response

    async def select(self, request: pb.SelectRequest, context: aio.ServicerContext,
                     calls: TableCalls | None = None, *, serialized: bool = False) -> pb.SelectResponse | bytes:
        """Lease ``num_samples`` items (fewer only if the timeout passes after some were picked).

        Waits on the table's rate limiter like the Sample RPC; gives up (CANCELLED)
        when the RPC ends or the session is closed meanwhile. With ``num_batches`` > 1,
        further batches of ``num_samples`` follow in the same answer as long as the
        rate limiter allows them at once (each batch its own lease). ``calls``: where
        the table work runs (default the daemon's pool; the local lane runs it inline).
        ``serialized``: the answer as its serialized bytes (``encode_select_response``: the local lane's).
        """
        calls = calls if calls is not None else self.calls
        session = await self._session(request.session_id, context)
        n = int(request.num_samples)
        batches = max(1, int(request.num_batches))
        if n < 1 or n * batches > MAX_SELECT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_samples ({n}) x num_batches ({batches}) must be in [1, {MAX_SELECT}]")
        stale: list[int] = []
        ended = list(request.release_lease_ids)

        def release_first() -> None:  # leases the learner is done with (takes table locks: on the pool)
            stale.extend(self.sessions.release(session, ended))
            self._release_retired(session)

        table = session.table
        timeout = request.timeout_ms / 1000.0 if request.timeout_ms > 0 else None
        started = time.perf_counter()
        task = asyncio.current_task()
        entry = (asyncio.get_running_loop(), task)
        with self._selects_lock:  # a close of the session cancels this call while it waits
            self._selects.setdefault(session.session_id, set()).add(entry)
        try:
            if session.closed:
                raise asyncio.CancelledError
            if session.group is not None:
                if batches > 1:
                    raise ValueError("a rank of a selection group selects one batch per Select (num_batches 1)")
                if ended:
                    await calls.run(release_first)
                picked = [await self._group_slice(session, request, n, timeout, calls)]
            else:
                picked = await calls.sample_batches(table, n, timeout, batches, by_reference=True,
                                                    prelude=release_first if ended else None)
        except StepGone as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except NeedsInlinePlane as exc:  # nothing was taken: the learner negotiates again and is answered inline
            self.sessions.close(session.session_id)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"data-plane session closed: {exc}")
        except asyncio.CancelledError:
            if session.closed and task.uncancel() == 0:  # the session's close, not the call's end
                await context.abort(grpc.StatusCode.CANCELLED, "select cancelled (the session was closed)")
            raise
        except Exception as e:  # noqa: BLE001 - mapped to a status by abort_for
            await abort_for(context, e)
        finally:
            with self._selects_lock:
                waiting = self._selects.get(session.session_id)
                if waiting is not None:
                    waiting.discard(entry)
                    if not waiting:
                        del self._selects[session.session_id]
        if self.metrics is not None:
            for selection in picked:
                self.metrics.plane_selected(table, session.kind, selection, time.perf_counter() - started)
        lease_ids = []
        for selection in picked:
            lease_id = self.sessions.add_lease(session, selection.lease_ids, selection.slots, selection.generations)
            if lease_id is None:  # the session closed meanwhile
                self.sessions.release(session, lease_ids)
                for rest in picked[len(lease_ids):]:
                    for table_lease in rest.lease_ids:
                        table.release(table_lease)
                await context.abort(grpc.StatusCode.NOT_FOUND, f"data-plane session {session.session_id!r} closed")
            lease_ids.append(lease_id)
        if not len(picked[0]):  # a group step cut short by the timeout before this rank's slice
            self.sessions.release(session, lease_ids)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the group's step was cut short by the timeout before this rank's slice")
        joined = picked[0] if len(picked) == 1 else JoinedSelection([p for s in picked for p in s.parts])
        response = pb.SelectResponse(layout_version=int(joined.layout_version), lease_id=int(lease_ids[0]))
        if batches > 1:
            response.batch_lease_ids.extend(lease_ids)
            response.batch_sizes.extend(len(s) for s in picked)
        response.stale_lease_ids.extend(stale)
        if joined.layout_version != session.layout_version:
            try:
                await calls.run(self._send_layout, session, table, response, context)
            except OSError as exc:
                self.sessions.release(session, lease_ids)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if session.kind == negotiation.DEVICE:
            fill_mirror_rows(response, table, joined)
        if serialized:
            return encode_select_response(response, joined)
        fill_select_tensors(response, joined)
        return response

    async def _group_slice(self, session: Session, request: pb.SelectRequest, n: int, timeout: float | None,
                           calls: TableCalls):
        """This rank's slice of its group's step ``request.group_step`` (the first rank to ask makes the
        step's selection, seeded by (seed, step); the others wait for it)."""
        group = session.group
        if request.group_picks > 0:
            asked, offset = int(request.group_picks), int(request.group_offset)
            if offset < 0 or offset + n > asked:
                raise ValueError(f"slice [{offset}, {offset + n}) is outside the step's {asked} picks")
        else:
            asked, offset = group.world_size * n, session.rank * n
        if asked > MAX_SELECT:
            raise ValueError(f"a step of {asked} picks is more than {MAX_SELECT}")
        while True:
            # begin, made and claim run here, never awaited: a call cancelled at an await between them would
            # leave a step nobody makes or picks no lease holds (each takes the table's lock only briefly)
            step, makes, dropped = self.groups.begin(group, int(request.group_step), asked)
            if dropped:
                calls.executor.submit(self.groups.release, session.table, dropped)
            if makes:
                try:
                    selection = await calls.sample(session.table, asked, timeout, by_reference=True,
                                                   rng=step_rng(group.seed, step.step))
                except BaseException as exc:
                    self.groups.failed(group, step, exc if isinstance(exc, Exception) else MakerLeft())
                    raise
                self.groups.made(group, step, selection)
            else:
                try:
                    await asyncio.shield(asyncio.wrap_future(step.ready))
                except MakerLeft:
                    continue  # its maker's call ended first: this rank makes the step
            return self.groups.claim(group, step, offset, offset + n)

    def _stream_layout(self, table: Table, grant: StreamGrant, layout: TableLayout | None) -> TableLayout | None:
        """Open the segment file of the table's layout for a stream session; returns that layout.

        A growth between reading the layout and opening its file renames or replaces
        the file: the layout is read again (a few times at most).
        """
        for _ in range(8):
            if layout is None:
                return None
            try:
                self.stream.attach(grant, layout)
                return layout
            except FileNotFoundError:
                newer = table.layout()
                if newer is None or newer.version == layout.version:
                    raise
                layout = newer
        raise OSError(f"table '{table.name}' keeps moving to new segments; cannot open one for streaming")

    def _nixl_layout(self, table: Table, grant: NixlGrant, layout: TableLayout | None,
                     watermark: int = 0) -> tuple[TableLayout | None, pb.NixlRegion | None]:
        """Register the segment of the table's layout with the agent for a nixl session; (layout, its region).

        A growth between reading the layout and mapping its file replaces the file:
        the layout is read again (a few times at most).
        """
        for _ in range(8):
            if layout is None:
                return None, None
            try:
                return layout, self.nixl.attach(grant, layout, watermark)
            except FileNotFoundError:
                newer = table.layout()
                if newer is None or newer.version == layout.version:
                    raise
                layout = newer
        raise OSError(f"table '{table.name}' keeps moving to new segments; cannot register one with NIXL")

    def _send_layout(self, session: Session, table: Table, response: pb.SelectResponse,
                     context: aio.ServicerContext) -> None:
        """Attach the table's current layout (a growth copies every slot, so it addresses the refs too).

        OSError when the grown segment cannot be registered for RDMA or opened for streaming.
        """
        layout = table.layout()
        if isinstance(session.resources, StreamGrant):
            layout = self._stream_layout(table, session.resources, layout)
        elif isinstance(session.resources, NixlGrant):
            try:
                # leases up to this Select's may address the segment read so far
                layout, region = self._nixl_layout(table, session.resources, layout, session.next_lease)
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 - the agent's own errors
                raise OSError(f"registering the grown segment with NIXL failed: {exc}") from exc
            response.nixl.CopyFrom(region)
        response.layout_version = layout.version
        response.layout.CopyFrom(layout.to_proto())
        if session.resources is not None and self.rdma is not None and session.kind == negotiation.RDMA:
            try:
                response.region.CopyFrom(self.rdma.attach(session.resources, layout))
            except Exception as exc:  # noqa: BLE001 - pyverbs errors vary
                raise OSError(f"registering the grown segment for RDMA failed: {exc}") from exc
        session.layout_version = layout.version

    async def release(self, request: pb.ReleaseRequest, context: aio.ServicerContext,
                      calls: TableCalls | None = None) -> pb.ReleaseResponse:
        session = await self._session(request.session_id, context)
        calls = calls if calls is not None else self.calls
        stale = await calls.run(self.sessions.release, session, list(request.lease_ids))
        self._release_retired(session)
        return pb.ReleaseResponse(stale_lease_ids=stale)

    def _release_retired(self, session: Session) -> None:
        """A nixl session's earlier segments go once none of its open leases may address them."""
        grant = session.resources
        if isinstance(grant, NixlGrant) and grant.retired and self.nixl is not None:
            self.nixl.release_retired(grant, self.sessions.oldest_lease(session))

    async def close(self, request: pb.CloseDataPlaneRequest,
                    context: aio.ServicerContext) -> pb.CloseDataPlaneResponse:
        await self.calls.run(self.sessions.close, request.session_id)  # closing twice is harmless
        return pb.CloseDataPlaneResponse()


def fill_mirror_rows(response: pb.SelectResponse, table: Table, selection: JoinedSelection) -> None:
    """A device session's answer: each item's row in the table's GPU mirror (-1: read it from the segment).

    Called after the leases are taken, so a listed row is not rewritten while they hold. Rows are listed
    only in the row size of the layout the learner addresses the answer by (the table's current one).
    """
    layout = table.layout()
    current = layout is not None and layout.columns and layout.version == response.layout_version
    row_bytes = layout.columns[0].slot_stride if current else 0
    rows = table.mirror.rows_for(selection.slots, selection.generations, row_bytes)
    response.mirror_rows.dtype = rows.dtype.str
    response.mirror_rows.shape.append(len(rows))
    response.mirror_rows.data = rows.tobytes()


# The per-item fields of a SelectResponse: (field, wire dtype), item i at index i of each.
SELECT_TENSORS = (("slots", "<i8"), ("generations", "<u8"), ("lengths", "<i4"), ("keys", "<u8"),
                  ("probabilities", "<f8"), ("table_sizes", "<i8"), ("priorities", "<f8"), ("times_sampled", "<i4"))
_WIRE_DTYPES = {name: np.dtype(dtype) for name, dtype in SELECT_TENSORS}


def _select_arrays(selection: JoinedSelection) -> list[tuple[str, np.ndarray]]:
    """(field, array in its wire dtype) of every per-item field of ``selection`` (lengths as [n, C])."""
    out = []
    for name, dtype in _WIRE_DTYPES.items():
        a = getattr(selection, name)
        if name == "lengths":
            a = np.asarray(a).reshape(len(selection.slots), -1)
        if a.dtype != dtype:
            a = a.astype(dtype)
        out.append((name, a))
    return out


def fill_select_tensors(response: pb.SelectResponse, selection: JoinedSelection) -> None:
    """Every per-item field of the selection into ``response`` as one raw little-endian array (item i at index i).

    Each is set in the response's own Tensor (one built apart and then assigned is copied once
    more; ``tobytes`` packs a strided array in the same one copy).
    """
    for name, a in _select_arrays(selection):
        tensor = getattr(response, name)
        tensor.dtype = a.dtype.str
        tensor.shape.extend(a.shape)
        tensor.data = a.tobytes()


def encode_select_response(head: pb.SelectResponse, selection: JoinedSelection) -> bytes:
    """``head`` (every field but the per-item ones) serialized, then the selection's per-item fields framed
    by hand (``wire.encode_tensor_fields``): the bytes of ``head`` after ``fill_select_tensors``, its arrays
    copied once instead of into the message and again out of it."""
    return encode_tensor_fields(pb.SelectResponse, _select_arrays(selection), head.SerializeToString())
