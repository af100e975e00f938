"""DataPlaneManager: the daemon's handlers for OpenDataPlane, Select, Release and CloseDataPlane.

``ReplayService`` delegates the four RPCs here. ``open`` negotiates the plane
(gear_contract.negotiation) and returns what it needs: the table
layout for shm (the learner maps the segment), the layout plus the daemon's
queue pairs and the segment's memory region for rdma, nothing for inline (the
learner then samples with the Sample RPC). ``select`` samples like the Sample
RPC but returns item references (slot, generation, lengths) with their
SampleInfo and leases the slots; ``release`` ends leases and says which were
stale. A reaper thread ends leases past their timeout and sessions left idle,
so a learner that dies leaks nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_server.data_planes.offers import gpu_off_reason, plane_report
from gear_server.data_planes.sessions import SessionNotFoundError, SessionRegistry, peer_identity
from gear_server.data_planes.settings import DataPlaneSettings
from gear_server.errors import CallCancelled, RateLimiterTimeout, TableClosedError, TableNotFoundError

log = logging.getLogger(__name__)

DEFAULT_LEASE_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 600.0
MAX_SELECT = 1 << 20  # items per Select


class DataPlaneManager:
    """Sessions and leases of learner data planes over a daemon's tables."""

    def __init__(self, tables: Mapping[str, Any], host_id: str, *, rdma: Any = "auto",
                 lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 reap_interval_s: float | None = None, settings: DataPlaneSettings | None = None):
        self.tables = tables  # the daemon's dict: tables added later are seen
        self.host_id = host_id
        settings = settings or DataPlaneSettings()
        rdma_off = None
        if rdma == "auto":
            from gear_server.data_planes.rdma_server import RdmaServer

            rdma, rdma_off = RdmaServer.open(settings)
        elif rdma is None:
            rdma_off = "not attached"
        self.rdma = rdma
        self.report = plane_report(rdma_off, gpu_off_reason())  # the daemon logs report.line() at start
        self.metrics: Any = None  # gear_server.metrics.ServerMetrics, set by the daemon
        self.sessions = SessionRegistry(lease_timeout_s=lease_timeout_s, idle_timeout_s=idle_timeout_s,
                                        max_sessions=settings.max_sessions,
                                        max_sessions_per_peer=settings.max_sessions_per_peer,
                                        on_close=self._on_session_closed)
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

    def _on_session_closed(self, session) -> None:
        if session.resources is not None and self.rdma is not None:
            try:
                self.rdma.close_session(session.resources)
            except Exception:  # noqa: BLE001
                log.exception("closing RDMA resources of session %s failed", session.session_id)

    # ---------------------------------------------------------------- helpers
    def _table(self, name: str, context: grpc.ServicerContext) -> Any:
        table = self.tables.get(name)
        if table is None:
            context.abort(grpc.StatusCode.NOT_FOUND, str(TableNotFoundError(name)))
        return table

    def _session(self, session_id: str, context: grpc.ServicerContext):
        try:
            return self.sessions.get(session_id)
        except SessionNotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def _timeouts(self) -> dict[str, int]:
        return {"lease_timeout_ms": int(self.sessions.lease_timeout_s * 1000),
                "session_idle_timeout_ms": int(self.sessions.idle_timeout_s * 1000)}

    # ---------------------------------------------------------------- RPCs
    def open(self, request: pb.OpenDataPlaneRequest, context: grpc.ServicerContext) -> pb.OpenDataPlaneResponse:
        table = self._table(request.table, context)
        try:
            kind = negotiation.choose_plane(request.offer, self.host_id, self.rdma is not None)
        except negotiation.NoCommonPlaneError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
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
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"RDMA endpoint refused: {exc}")
            except Exception as exc:  # noqa: BLE001 - the device failed: serve the learner inline
                if resources is not None:
                    self.rdma.close_session(resources)
                log.warning("RDMA connection for table '%s' failed, answering inline: %s", table.name, exc)
                return pb.OpenDataPlaneResponse(kind=negotiation.INLINE, **self._timeouts())
        try:
            session = self.sessions.create(table, kind, resources, peer=peer_identity(context))
        except OverflowError as exc:
            if resources is not None:
                self.rdma.close_session(resources)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        response = pb.OpenDataPlaneResponse(session_id=session.session_id, kind=kind, **self._timeouts())
        if layout is not None:
            session.layout_version = layout.version
            response.layout.CopyFrom(layout.to_proto())
        if endpoint is not None:
            response.rdma.CopyFrom(endpoint)
        if region is not None:
            response.region.CopyFrom(region)
        return response

    def select(self, request: pb.SelectRequest, context: grpc.ServicerContext) -> pb.SelectResponse:
        """Lease ``num_samples`` items (fewer only if the timeout passes after some were picked).

        Blocks on the table's rate limiter like the Sample RPC; gives up (CANCELLED)
        when the RPC ends or the session is closed meanwhile.
        """
        session = self._session(request.session_id, context)
        n = int(request.num_samples)
        if n < 1 or n > MAX_SELECT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_samples ({n}) must be in [1, {MAX_SELECT}]")
        stale = self.sessions.release(session, request.release_lease_ids) if request.release_lease_ids else []
        table = session.table
        timeout = request.timeout_ms / 1000.0 if request.timeout_ms > 0 else None
        ended = threading.Event()

        def on_done() -> None:
            ended.set()
            table.wake_waiters()

        if not context.add_callback(on_done):
            ended.set()
        started = time.perf_counter()
        try:
            selection = table.sample(n, timeout=timeout, abandoned=lambda: ended.is_set() or session.closed)
        except CallCancelled:
            context.abort(grpc.StatusCode.CANCELLED, "select cancelled (call ended or session closed)")
        except RateLimiterTimeout as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or f"rate limiter of '{table.name}' timed out")
        except TableClosedError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc) or "table closed")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.metrics is not None:
            self.metrics.plane_selected(table, session.kind, selection, time.perf_counter() - started)
        lease_id = self.sessions.add_lease(session, [selection.lease_id], selection.slots, selection.generations)
        if lease_id is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"data-plane session {session.session_id!r} closed")
        if ended.is_set():  # cancelled meanwhile (a learner closing its pipeline): nobody will release it
            self.sessions.release(session, [lease_id])
            context.abort(grpc.StatusCode.CANCELLED, "select cancelled (call ended)")
        if request.packed:
            response = build_packed_select_response(selection, lease_id)
        else:
            response = build_select_response(selection, lease_id)
        response.stale_lease_ids.extend(stale)
        if selection.layout_version != session.layout_version:
            self._send_layout(session, table, response, context)
        return response

    def _send_layout(self, session, table: Any, response: pb.SelectResponse, context: grpc.ServicerContext) -> None:
        """Attach the table's current layout (a growth copies every slot, so it addresses the refs too)."""
        layout = table.layout()
        response.layout_version = layout.version
        response.layout.CopyFrom(layout.to_proto())
        if session.resources is not None and self.rdma is not None:
            try:
                response.region.CopyFrom(self.rdma.attach(session.resources, layout))
            except Exception as exc:  # noqa: BLE001
                self.sessions.release(session, [response.lease_id])
                context.abort(grpc.StatusCode.UNAVAILABLE, f"registering the grown segment for RDMA failed: {exc}")
        session.layout_version = layout.version

    def release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        session = self._session(request.session_id, context)
        stale = self.sessions.release(session, request.lease_ids)
        return pb.ReleaseResponse(stale_lease_ids=stale)

    def close(self, request: pb.CloseDataPlaneRequest, context: grpc.ServicerContext) -> pb.CloseDataPlaneResponse:
        self.sessions.close(request.session_id)  # closing twice is harmless
        return pb.CloseDataPlaneResponse()


def build_select_response(selection: Any, lease_id: int) -> pb.SelectResponse:
    """Item references and SampleInfos of a leased selection."""
    lengths = np.asarray(selection.lengths, dtype=np.int32)
    lengths = lengths.reshape(len(selection.slots), -1)
    response = pb.SelectResponse(layout_version=int(selection.layout_version), lease_id=int(lease_id))
    refs = response.refs
    for slot, gen, lens in zip(selection.slots.tolist(), selection.generations.tolist(), lengths.tolist(),
                               strict=True):
        refs.add(slot=slot, generation=gen, lengths=lens)
    infos = response.info
    for k, p, s, q, t in zip(selection.keys.tolist(), selection.probabilities.tolist(),
                             selection.table_sizes.tolist(), selection.priorities.tolist(),
                             selection.times_sampled.tolist(), strict=True):
        infos.add(key=k, probability=p, table_size=s, priority=q, times_sampled=t)
    return response


def _tensor(array: np.ndarray, dtype: str) -> pb.Tensor:
    a = np.ascontiguousarray(array, dtype=np.dtype(dtype))
    return pb.Tensor(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes())


def build_packed_select_response(selection: Any, lease_id: int) -> pb.SelectResponse:
    """The packed form: every per-item field as one raw little-endian array."""
    n = len(selection.slots)
    return pb.SelectResponse(
        layout_version=int(selection.layout_version), lease_id=int(lease_id),
        slots=_tensor(selection.slots, "<i8"), generations=_tensor(selection.generations, "<u8"),
        lengths=_tensor(np.asarray(selection.lengths).reshape(n, -1), "<i4"),
        keys=_tensor(selection.keys, "<u8"), probabilities=_tensor(selection.probabilities, "<f8"),
        table_sizes=_tensor(selection.table_sizes, "<i8"), priorities=_tensor(selection.priorities, "<f8"),
        times_sampled=_tensor(selection.times_sampled, "<i4"),
    )
