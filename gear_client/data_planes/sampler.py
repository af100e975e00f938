"""PlaneSampler: a learner's batches from one table over the best plane it can negotiate.

It opens a data-plane session (offering shm, rdma and inline as allowed and
available), then for each batch selects items, moves their bytes over the plane
and releases the lease. It talks to planes only through the protocols of
``plane`` (a ``ReadingPlane`` for shm and rdma, a ``SamplingPlane`` for inline).
It recovers by itself from what happens in a long run:

* the plane fails to come up (segment not openable, RDMA connection refused):
  the session is closed and the next best plane negotiated;
* the table's layout changed (first item, or growth): re-open, select again;
* the table grew again before a new layout was mapped (its segment is already
  unlinked): that selection is released unread and a later answer brings the
  newer layout, on the same plane;
* the session was reaped (learner idle past the daemon's timeout): re-open;
* a lease came back stale (expired while reading, or a slot rewritten): the
  batch is dropped and selected again, so a torn item never reaches the learner.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import grpc

from gear_client import errors
from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.opening import PlaneOpener
from gear_client.data_planes.pipeline import (
    PIPELINE_DEPTH,
    PIPELINE_PREFETCH,
    LayoutStep,
    PipelineState,
    drain,
    gathers_in_flight,
    select_width,
)
from gear_client.data_planes.plane import Plane, PlaneInterrupted, ReadingPlane, SamplingPlane
from gear_client.data_planes.projection import ColumnChoice
from gear_client.data_planes.range_planning import WindowSpec
from gear_client.data_planes.ranks import selection_group
from gear_client.data_planes.session import GroupSlice, ItemSelection, PlaneSession
from gear_client.data_planes.shm import is_gpu_device
from gear_client.data_planes.targets import connect
from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_contract.projection import UnknownFieldError

__all__ = ["MAX_OUTGROWN_LAYOUTS", "MAX_STALE_RETRIES", "LayoutStep", "PipelineState", "PlaneSampler",
           "SamplerClosedError", "StaleBatchError", "gathers_in_flight", "select_width"]

log = logging.getLogger(__name__)

MAX_STALE_RETRIES = 32
MAX_REOPENS = 8  # re-negotiations for one batch before giving up
# Layouts in a row whose segment was gone (the table grew again) before the plane fell back: a
# segment that never shows up (another /dev/shm behind one host identity) is not a growth race.
MAX_OUTGROWN_LAYOUTS = 8
# close() waits at most this long (seconds) for a thread inside a call of this sampler; at exit, _EXIT_WAIT_S.
CLOSE_WAIT_S = 5.0
_EXIT_WAIT_S = 0.5


class Retry(enum.Enum):
    """Why one select-read-release round gave no batch (sample() then tries again)."""

    STALE = "stale"  # the lease came back stale: the bytes cannot be trusted
    REOPENED = "reopened"  # the session or the plane was re-negotiated
    OUTGROWN = "outgrown"  # the layout's segment was gone before it was mapped: a later answer brings the newer


_open_samplers: weakref.WeakSet[PlaneSampler] = weakref.WeakSet()


@atexit.register
def _close_open_samplers() -> None:
    """Close the samplers still open at exit, while gRPC's threads still run.

    Once the interpreter finalizes, gRPC's threads are frozen, possibly holding
    a call's lock, and a call still in flight (a Select sent ahead by a pipeline
    nobody closed, a plane being opened) could block the exit forever. Closing
    ends those calls and frees the leases at once, not after their timeout, and
    waits only briefly for a thread still inside one.
    """
    for sampler in list(_open_samplers):
        try:
            sampler.close(wait=_EXIT_WAIT_S)
        except Exception:  # noqa: BLE001 - the daemon reaps the session anyway
            log.debug("closing a sampler at exit failed", exc_info=True)


class StaleBatchError(RuntimeError):
    """Every attempt at a batch came back stale (the learner is too slow for the lease timeout)."""


class SamplerClosedError(RuntimeError):
    """The sampler was closed (possibly while a sample waited)."""


class PlaneSampler:
    """Batches of one table over the best negotiated plane (see module docstring). Thread safe."""

    def __init__(self, target: Any, table: str, *, planes=None, device: Any = None, rdma_device: str | None = None,
                 num_qps: int | None = None, metadata=None, host_id: str | None = None,
                 max_stale_retries: int = MAX_STALE_RETRIES, rdma_connection=None, columns: Any = None,
                 rank: int | None = None, world_size: int | None = None, seed: int | None = None,
                 group_id: str | None = None, from_torch: bool = True, stream_connections: int | None = None):
        """``columns``: only these fields move (paths like "obs/rgb", or a nest of the wanted fields;
        gear_contract.projection). ``rank``/``world_size`` (default: torch.distributed's when it is initialised),
        ``seed`` and ``group_id``: this sampler is rank ``rank`` of a data-parallel group that shares one
        selection per step (gear_client.data_planes.ranks); a seed alone makes a world 1 sampler's selections
        reproducible for a given table state. ``from_torch`` False: rank and world size never come from
        torch.distributed (Reverb-facing samplers). ``stream_connections``: at most this many bulk connections
        on the stream plane (None: as many as the daemon allows)."""
        self.table = table
        self.group = selection_group(table, rank=rank, world_size=world_size, seed=seed, group_id=group_id,
                                     from_torch=from_torch)
        self.step = 0  # the group's next step this rank takes a slice of
        self.metadata = metadata
        self.max_stale_retries = max_stale_retries
        self._stub, self._sample_call, self._channel, self._daemon = connect(target)
        self._opener = PlaneOpener(self._stub, table, planes=negotiation.normalise_planes(planes),
                                   host_id=host_id or negotiation.local_host_id(), device=device,
                                   rdma_device=rdma_device, num_qps=num_qps, metadata=metadata, daemon=self._daemon,
                                   sample_call=self._sample_call, rdma_connection=rdma_connection,
                                   group=self.group, columns=ColumnChoice(columns) if columns is not None else None,
                                   stream_connections=stream_connections)
        self._excluded: set[str] = set()
        self._lock = threading.RLock()
        self._reader: ReadingPlane | None = None  # shm or rdma, with self._session
        self._inline: SamplingPlane | None = None
        self._session: PlaneSession | None = None
        self._layout: TableLayout | None = None
        self.stale_batches = 0  # batches dropped because their lease came back stale
        self.reopens = 0
        self.outgrown_layouts = 0  # layouts skipped because the table grew again before they were mapped
        self.selects = 0  # Selects answered (pipelined ones carry several batches)
        self._outgrown_in_row = 0
        self._gone_version = -1  # the newest layout version whose segment was found unlinked
        self._group_slice: GroupSlice | None = None  # set by sample_slice for one Select
        self.closed = False
        _open_samplers.add(self)

    # ----------------------------------------------------------------- opening
    @property
    def planes(self) -> tuple[str, ...]:
        """The planes this sampler may use, best first."""
        return self._opener.planes

    @property
    def host_id(self) -> str:
        """The host identity offered for shm (same host, same memory)."""
        return self._opener.host_id

    @property
    def device(self) -> Any:
        """Where batches are gathered (None: host memory; a CuPy device: GPU)."""
        return self._opener.device

    @property
    def _plane(self) -> Plane | None:
        return self._reader if self._reader is not None else self._inline

    @property
    def kind(self) -> str | None:
        """The plane in use ("shm", "rdma", "stream", "inline"), or None before the first open."""
        with self._lock:
            if self._session is not None:
                return self._session.kind
            plane = self._plane
            return plane.kind if plane is not None else None

    def table_info(self) -> pb.TableInfo:
        """The table's configuration and counters (ServerInfo); KeyError naming the table if the daemon has none."""
        try:
            if self._daemon is not None:
                self._daemon.wait_ready("server_info")
            response = self._stub.ServerInfo(pb.ServerInfoRequest(), metadata=self.metadata,
                                             wait_for_ready=self._daemon is None)
        except grpc.RpcError as exc:
            connect_error = self._daemon.error_for(exc, "server_info") if self._daemon is not None else None
            raise (connect_error or errors.from_rpc_error(exc, "server_info")) from exc
        for info in response.table_info:
            if info.name == self.table:
                return info
        raise KeyError(f"the daemon has no table '{self.table}'")

    def _open(self) -> None:
        """Negotiate a plane (``PlaneOpener``: falls back plane by plane until one comes up)."""
        opened = self._opener.open(self._excluded)
        self._reader, self._inline, self._session, self._layout = (opened.reader, opened.inline, opened.session,
                                                                   opened.layout)
        if self.closed:  # closed meanwhile (close() could not take the lock): free what just came up
            self._drop_plane()
            raise SamplerClosedError("the sampler was closed while its plane opened")

    def _drop_plane(self) -> None:
        plane, session = self._plane, self._session
        self._reader = self._inline = None
        self._session = None
        if plane is not None:
            try:
                plane.close()
            except Exception:  # noqa: BLE001 - closing goes on: the session still ends
                log.debug("closing plane failed", exc_info=True)
        if session is not None:
            session.close()

    def _reopen(self, exclude: str | None = None) -> None:
        self.reopens += 1
        if exclude:
            self._excluded.add(exclude)
        self._drop_plane()
        self._open()

    def _ensure_open(self) -> None:
        if self.closed:
            raise SamplerClosedError("this sampler is closed")
        if self._plane is None:
            self._open()

    def open(self) -> str:
        """Negotiate now (sample() does it on first use); returns the plane's kind."""
        with self._lock:
            self._ensure_open()
            return self.kind

    @property
    def bytes_moved(self) -> int:
        """Item bytes this sampler's current plane moved: read from the segment (shm, rdma) or received in
        Sample answers (inline, headers included); what ``columns=`` narrows."""
        plane = self._plane
        return plane.bytes_moved if plane is not None else 0

    def item_bytes(self) -> int:
        """One item's bytes in the table's segment (negotiating first if need be); 0 when the plane has no
        layout to tell (inline)."""
        with self._lock:
            self._ensure_open()
            layout = self._layout
        # slot-major segments: every column's slot_stride is the whole row, one item's bytes
        return layout.columns[0].slot_stride if layout is not None and layout.columns else 0

    # ----------------------------------------------------------------- sampling
    def sample(self, num_samples: int, *, window: WindowSpec = None, timeout: float | None = None) -> SampledBatch:
        """``num_samples`` items (fewer only when ``timeout`` passes after some were picked), padded per ``window``.

        One Select (or one Sample call inline) for exactly this batch: nothing is
        taken from the table that this call does not return.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        with self._lock:
            self._ensure_open()
            try:
                return self._sample_locked(num_samples, window, timeout)
            except Exception as exc:
                if self.closed:
                    self._drop_plane()  # close() may have left it to this thread (it held the lock)
                    raise SamplerClosedError("the sampler was closed while sampling") from exc
                raise

    def _sample_locked(self, num_samples: int, window: WindowSpec, timeout: float | None) -> SampledBatch:
        stale = retries = 0
        while True:
            self._ensure_open()
            if self._inline is not None:
                try:
                    return self._inline.sample(num_samples, window=window, timeout=timeout)
                except grpc.RpcError as exc:
                    raise errors.from_rpc_error(exc, "sample") from exc
            outcome = self._sample_referenced(num_samples, window, timeout)
            if isinstance(outcome, SampledBatch):
                return outcome
            if outcome is Retry.STALE:
                stale += 1
                self.stale_batches += 1
                if stale > self.max_stale_retries:
                    raise StaleBatchError(f"{stale} batches in a row from table '{self.table}' came back stale")
            elif outcome is Retry.REOPENED:
                retries += 1
                if retries > MAX_REOPENS:
                    raise RuntimeError(f"the data plane of table '{self.table}' keeps changing "
                                       f"({retries} re-negotiations for one batch)")
            # Retry.OUTGROWN: the next Select brings the newer layout (bounded by MAX_OUTGROWN_LAYOUTS)

    def _next_step(self, picks: int = 0, offset: int = 0) -> GroupSlice | None:
        """This rank's slice of the group's next step (None: no group); lock held."""
        if self.group is None:
            return None
        step, self.step = self.step, self.step + 1
        return GroupSlice(step, picks, offset)

    def _sample_referenced(self, num_samples: int, window: WindowSpec, timeout: float | None) -> SampledBatch | Retry:
        """One select-read-release round on shm/rdma: a batch, or why there is none."""
        session, plane = self._session, self._reader
        assert session is not None and plane is not None
        ncols = len(self._layout.columns) if self._layout is not None else None
        slice_ = self._group_slice if self._group_slice is not None else self._next_step()
        try:
            selection = session.select(num_samples, ncols, timeout, step=slice_)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and not self.closed:  # session reaped: open a new one
                self._reopen()
                return Retry.REOPENED
            raise errors.from_rpc_error(exc, "sample") from exc
        self.selects += 1
        try:
            if selection.layout is not None:  # first items, or the table grew: same lease, new segment
                if not self._map_layout(plane, selection.layout, selection.region):
                    self._release_quietly(session, selection.lease_id)
                    return Retry.OUTGROWN
            elif self._layout is None or selection.layout_version != self._layout.version:
                self._release_quietly(session, selection.lease_id)
                self._reopen()
                return Retry.REOPENED
            batch = plane.fetch(selection, window)
        except Exception as exc:  # noqa: BLE001 - the plane broke (RDMA error, unmapped segment): next best
            if self.closed or isinstance(exc, UnknownFieldError):
                self._release_quietly(session, selection.lease_id)
                raise
            self._release_quietly(session, selection.lease_id)
            if isinstance(exc, PlaneInterrupted):  # a lost connection: the same plane may come back
                log.warning("%s plane lost its connection (%s); negotiating again", plane.kind, exc)
                self._reopen()
            else:
                log.warning("%s plane failed while reading (%s); falling back", plane.kind, exc)
                self._reopen(exclude=plane.kind)
            return Retry.REOPENED
        try:
            stale = session.release([selection.lease_id])
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and not self.closed:
                self._reopen()
                return Retry.STALE  # the lease ended with the session: the bytes cannot be trusted
            raise errors.from_rpc_error(exc, "sample") from exc
        if selection.lease_id in stale:
            return Retry.STALE
        return batch

    def sample_slice(self, part: GroupSlice, num_samples: int, *, window: WindowSpec = None,
                     timeout: float | None = None) -> SampledBatch:
        """Picks [part.offset, part.offset + num_samples) of the group's step ``part.step`` of ``part.picks``
        picks: a sharded rank's part on this shard (shm or rdma, in a group)."""
        if self.group is None:
            raise ValueError("sample_slice needs a sampler in a selection group (rank, world_size or seed)")
        with self._lock:
            self._group_slice = part
            try:
                return self.sample(num_samples, window=window, timeout=timeout)
            finally:
                self._group_slice = None

    def batches(self, num_samples: int, *, window: WindowSpec = None, timeout: float | None = None,
                depth: int = PIPELINE_DEPTH, prefetch: int = PIPELINE_PREFETCH,
                batches_per_select: int | None = None) -> Iterator[SampledBatch]:
        """Batches without end, pipelined: Selects and gathers of later batches overlap the current one.

        Reads ahead: use it only on tables whose sampling neither consumes items
        nor is held back by a rate limiter (``read_ahead.may_read_ahead``); the
        datasets check. Up to ``prefetch`` Selects are on their way (the daemon
        picks the next batches while this learner gathers), each asking for
        ``batches_per_select`` batches at once (default: as many as fit
        ITEMS_PER_SELECT items, at most 8), so that small batches are not bound by
        the Select round trip: one gather reads them all (one kernel launch on a
        GPU) and they are handed out as ``num_samples``-item views of it. The
        oldest gather is waited for once enough are running for ``depth`` batches
        (``gathers_in_flight``; on a GPU each runs on its own stream). A Select's lease is ended by the next Select sent
        after its gather, whose answer says whether they were stale (then they are
        dropped); a batch is handed out only after that verdict, so it is complete
        and intact. A reaped session or a layout the pipeline cannot follow (a new
        segment that cannot be mapped) drains the pipeline and goes through
        ``sample()``'s recovery; an error while gathering ends the generator with
        that error. Closing the generator releases the leases still in flight. A
        stale batch means leases outlive the daemon's lease timeout: the pipeline
        then narrows to one Select ahead of one batch and two gathers.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if self.group is not None:
            batches_per_select = 1  # a rank takes one step's slice per Select
        per_select = select_width(num_samples, batches_per_select, gpu=is_gpu_device(self.device),
                                  item_bytes=self.item_bytes())
        while True:
            with self._lock:
                self._ensure_open()
                pipelined = self._session is not None
            if not pipelined:
                yield self.sample(num_samples, window=window, timeout=timeout)
                continue
            yield from self._pipeline(num_samples, window, timeout, gathers_in_flight(depth, per_select),
                                      max(1, prefetch), per_select)
            yield self.sample(num_samples, window=window, timeout=timeout)  # recovery, then pipeline again

    def _pipeline(self, num_samples: int, window: WindowSpec, timeout: float | None, depth: int, prefetch: int,
                  per_select: int) -> Iterator[SampledBatch]:
        """Select/gather/release in a pipeline until something needs sample()'s recovery (PipelineState's queues)."""
        session, plane = self._session, self._reader
        assert session is not None and plane is not None
        plane.pipelined()
        ncols = len(self._layout.columns) if self._layout is not None else None
        state = PipelineState(num_samples)
        try:
            while True:
                with self._lock:
                    if self.closed:
                        raise SamplerClosedError("this sampler is closed")
                    while len(state.selects) < prefetch:
                        state.selects.append(session.select_async(num_samples * per_select, ncols, timeout,
                                                                  state.to_release, self._next_step()))
                        state.to_release = []
                pending = state.selects.popleft()
                try:
                    selection, stale = pending.result()
                except grpc.RpcError as exc:
                    state.to_release.extend(pending.released)  # their verdicts are lost: the batches are dropped
                    for lease in pending.released:
                        state.verdicts.pop(lease, None)
                    if self.closed:
                        raise SamplerClosedError("the sampler was closed while sampling") from exc
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        return  # session reaped: sample() re-opens
                    raise errors.from_rpc_error(exc, "sample") from exc
                self.selects += 1
                dropped = state.judge(pending.released, stale)
                if dropped:
                    self.stale_batches += dropped
                    # leases outlive the lease timeout: hold fewer at a time (as many as unpipelined + 1)
                    depth, prefetch, per_select = min(depth, 2), 1, 1
                with self._lock:  # close() frees the plane under this lock: never start a gather on a freed one
                    if self.closed:
                        state.to_release.append(selection.lease_id)
                        raise SamplerClosedError("the sampler was closed while sampling")
                    try:
                        step = self._follow_layout(selection, state, plane)
                    except UnknownFieldError:
                        state.to_release.append(selection.lease_id)
                        raise
                    if step is LayoutStep.RECOVER:
                        state.to_release.append(selection.lease_id)
                        return
                    if step is LayoutStep.DROP:
                        state.to_release.append(selection.lease_id)
                    else:
                        ncols = len(self._layout.columns)
                        try:  # one gather for every batch this Select asked for, split when judged
                            state.gathering.append((selection.lease_id, plane.start(selection, window)))
                        except Exception:
                            state.to_release.append(selection.lease_id)
                            raise
                while len(state.gathering) >= depth:
                    state.finish_oldest()
                while state.ready:
                    yield state.ready.popleft()
        finally:
            drain(session, state)

    def _follow_layout(self, selection: ItemSelection, state: PipelineState, plane: ReadingPlane) -> LayoutStep:
        """Map the segment a selection addresses: gather it, drop it (release unread) or recover.

        Selects in flight can be answered in another order than they were sent,
        so the one that brings a new layout may come after others that already
        address it (then the layout is taken from the answers in flight) or
        before older ones (those are dropped).
        """
        current = self._layout.version if self._layout is not None else None
        version = selection.layout_version
        layout = selection.layout
        if layout is None and current is not None and version == current:
            return LayoutStep.GATHER
        if current is not None and version < current:
            return LayoutStep.DROP  # selected before the table grew, answered after a Select that saw the growth
        if version <= self._gone_version:
            return LayoutStep.DROP  # addresses a segment already unlinked: a later answer brings the newer layout
        if layout is not None and current is not None and layout.version == current:
            return LayoutStep.GATHER  # brought again (out of order): already mapped
        region = selection.region
        if layout is None:  # a newer segment, whose layout another answer in flight brings
            for other in state.selects:
                try:
                    later, _ = other.result()
                except grpc.RpcError:
                    break
                if later.layout is not None and later.layout.version == version:
                    layout, region = later.layout, later.region
                    break
            if layout is None:
                return LayoutStep.RECOVER  # should not happen: sample() re-opens
        state.finish_all()  # nothing may still read the old segment
        try:
            if not self._map_layout(plane, layout, region):
                return LayoutStep.DROP
        except UnknownFieldError:
            raise
        except Exception as exc:  # noqa: BLE001 - cannot map the new segment: next best plane
            log.warning("%s plane cannot switch to the new layout (%s); falling back", plane.kind, exc)
            with self._lock:
                self._excluded.add(plane.kind)
            return LayoutStep.RECOVER
        return LayoutStep.GATHER

    def _map_layout(self, plane: ReadingPlane, layout: TableLayout,
                    region: pb.RdmaRegion | pb.NixlRegion | None) -> bool:
        """Switch the plane to ``layout``; False if its segment is already gone because the table grew again.

        The daemon attaches the table's layout of the moment to an answer; a
        growth before the learner maps it unlinks that segment. The selection is
        then released unread: the daemon sends the newer layout with a later
        answer (the session's layout is still the one it sent). Too many such
        layouts in a row, and the error is raised (the plane falls back).
        """
        if self._opener.columns is not None:
            self._opener.columns.indices(layout)  # UnknownFieldError: not a plane failure (no fallback)
        try:
            plane.set_layout(layout, region)
        except FileNotFoundError as exc:
            self._outgrown_in_row += 1
            if self._outgrown_in_row > MAX_OUTGROWN_LAYOUTS:
                raise
            self.outgrown_layouts += 1
            self._gone_version = max(self._gone_version, layout.version)
            log.debug("layout v%d of table '%s' outgrown before it was mapped (%s)", layout.version, self.table, exc)
            return False
        self._outgrown_in_row = 0
        self._layout = layout
        return True

    @staticmethod
    def _release_quietly(session: PlaneSession, lease_id: int) -> None:
        try:
            session.release([lease_id])
        except grpc.RpcError:
            pass

    def close(self, wait: float = CLOSE_WAIT_S) -> None:
        """End the session (a sample blocked in another thread ends with SamplerClosedError) and free the plane.

        Never waits on a thread inside a blocking call for longer than ``wait``
        seconds: the session's Selects are ended, the inline plane's Sample call
        cancelled and the sampler's own channel closed (which cancels its calls
        in flight: a plane being opened, a lane being looked up) before the lock
        is taken; a thread that still holds it past ``wait`` frees the plane
        itself when its call returns.
        """
        if self.closed:
            return
        self.closed = True
        _open_samplers.discard(self)
        session, plane = self._session, self._plane
        if session is not None:
            session.close()  # the daemon ends a Select blocked on this session
        if plane is not None:
            plane.cancel()  # inline: ends a Sample call blocked in another thread
        if self._channel is not None:
            self._channel.close()
        if self._lock.acquire(timeout=wait):
            try:
                self._drop_plane()
            finally:
                self._lock.release()

    def __enter__(self) -> PlaneSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
