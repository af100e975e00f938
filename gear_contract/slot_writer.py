"""The writer side of the insert plane: fill a table's slots in shared memory, commit over gRPC.

Used by actors on the daemon's host (``gear_client``) and by the daemon's
ingest worker processes (``gear_server.ingest.worker_process``), both of which copy
rows straight into the table's segment so that no insert byte goes through
the daemon's interpreter. One ``SlotWriter`` owns one ``InsertPlane`` stream
(see gear_server/ingest/plane_service.py for the daemon's side):

* slots are reserved ahead, per table (``reserve_ahead``), so a write rarely
  waits for a round trip; a reservation is used only within half the daemon's
  reservation timeout from when it was asked for (the daemon gives it back at
  the full timeout, so an old reservation is never written);
* ``write`` copies an item's rows into a reserved slot of the newest mapping
  of the segment and queues its commit; commits go in batches, one in flight
  (under load many items share one message; a remote writer gathers a few
  while its rows are still on their way);
* a commit answered with a new layout (the table grew into a new segment
  while the rows were written) is finished here: the uncommitted items' rows
  are copied from the old mapping (still mapped) into the new segment and
  committed again;
* a mapping is not populated whole: the writer maps the page-table entries of
  the slots it reserves (``madvise(MADV_POPULATE_READ)``, Linux 5.14+, in the
  stream's reader thread, off the writing thread's path), so its cost follows
  the items it writes, not the table's capacity. Populating whole segments
  made every writer pay for every slot of every version the table grew
  through (the cost of an actor grew with the number of shards it writes to),
  and it allocated the whole capacity of a sparse segment (tmpfs allocates
  pages on read faults), where the daemon allocates rows as slots fill. Older
  kernels populate segments up to ``POPULATE_MAX_BYTES`` whole at map time;
* a writer never waits for ever: while it waits on the daemon, a ``DaemonWatch``
  (gear_contract/daemon_watch.py) probes it, and once neither the stream nor a
  probe got an answer for ``answer_timeout`` (the client's connect timeout) the
  stream fails with ``DaemonNotAnswering`` naming the address, its items left
  uncommitted (a daemon that holds commits back on its rate limiter still
  answers the probes, and is waited for);
* ``fits`` says whether an item can take this path: the table has a layout
  and the item has its structure, dtypes, step shapes and fits a slot.
  Anything else goes over InsertStream (a table still learning its layout, a
  longer item that makes the table grow, another host).

The segment is mapped read-write: the writer must run as the daemon's user
(segments are mode 0600); ``InsertPlaneUnavailable`` otherwise.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.daemon_watch import DaemonNotAnswering, DaemonWatch
from gear_contract.layout import TableLayout
from gear_contract.negotiation import local_host_id

INSERT_PLANE_METHOD = "/gear.v1.ReplayService/InsertPlane"
DEFAULT_RESERVE_AHEAD = 16
MAX_COMMIT_BATCH = 256
REMOTE_COMMIT_BATCH = 16  # items a remote writer's commit waits for while more rows are on their way
# Without per-range populating (kernels before 5.14), segments up to this size are mapped with MAP_POPULATE.
POPULATE_MAX_BYTES = 8 << 30
MADV_POPULATE_READ = 22  # Linux 5.14+; a read populate maps shared-memory pages writable (no write notification)
PAGE = mmap.PAGESIZE


class InsertPlaneUnavailable(RuntimeError):
    """This writer cannot use the insert plane (another host, no access to the segment, old daemon)."""


class OpenTimedOut(InsertPlaneUnavailable):
    """The daemon did not answer the stream's open in time."""


class SegmentGone(InsertPlaneUnavailable):
    """The segment of a layout no longer exists: the table moved to a newer one."""


_populate_fn: object = None  # None: not probed yet; False: unsupported; else libc's madvise
_probe_lock = threading.Lock()


def _madvise():
    """libc's madvise when ``MADV_POPULATE_READ`` works here (probed once on an anonymous page), else None."""
    global _populate_fn
    with _probe_lock:
        if _populate_fn is None:
            _populate_fn = _probe_populate()
    return _populate_fn or None


def _probe_populate():
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        fn.restype = ctypes.c_int
        probe = mmap.mmap(-1, PAGE)
        try:
            anchor = ctypes.c_char.from_buffer(probe)
            ok = fn(ctypes.addressof(anchor), PAGE, MADV_POPULATE_READ) == 0
            del anchor
        finally:
            probe.close()
    except (OSError, AttributeError, ValueError, BufferError):
        return False
    return fn if ok else False


def populates_by_slot() -> bool:
    """Whether writers map the pages of the slots they reserve only (else whole segments, at map time)."""
    return _madvise() is not None


class SegmentWriterMapping:
    """A read-write mapping of one table segment version with a view per column.

    The page-table entries of a slot are made when the slot is first reserved in this mapping
    (``claim`` under the writer's lock, then ``populate`` outside it), not for the whole segment.
    """

    def __init__(self, layout: TableLayout):
        self.layout = layout
        self._madvise = _madvise()
        try:
            fd = os.open(layout.segment, os.O_RDWR)
        except FileNotFoundError as e:
            raise SegmentGone(layout.segment) from e
        except OSError as e:
            raise InsertPlaneUnavailable(f"cannot open segment {layout.segment} for writing: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if size < layout.segment_size:
                raise InsertPlaneUnavailable(f"segment {layout.segment} holds {size} bytes, the layout needs "
                                             f"{layout.segment_size}")
            flags = mmap.MAP_SHARED
            if self._madvise is None and layout.segment_size <= POPULATE_MAX_BYTES:
                flags |= getattr(mmap, "MAP_POPULATE", 0)  # page-table entries now, not a fault per page written
            self._mmap = mmap.mmap(fd, layout.segment_size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.views = [layout.column_view(self._mmap, c) for c in range(len(layout.columns))]
        self._populated = np.zeros(layout.capacity, dtype=bool) if self._madvise is not None else None
        if self._populated is not None:
            anchor = ctypes.c_char.from_buffer(self._mmap)  # the export ends with ``anchor``; the address stays
            self._address = ctypes.addressof(anchor)
            del anchor

    def claim(self, slots: Sequence[int]) -> list[int]:
        """The slots among ``slots`` not yet populated in this mapping, marked as populated (writer's lock held)."""
        if self._populated is None:
            return []
        out = []
        for slot in slots:
            if 0 <= slot < len(self._populated) and not self._populated[slot]:
                self._populated[slot] = True
                out.append(slot)
        return out

    def populate(self, slots: Sequence[int]) -> None:
        """Map the pages of ``slots`` (every column's whole slot) now, one call per run of adjacent pages.

        Only an optimisation: a range that fails (no memory at the moment) is faulted in by the copy.
        Releases the GIL (a ctypes call), so the writing thread goes on meanwhile.
        """
        if self._madvise is None or not slots:
            return
        end_of_map = -(-self.layout.segment_size // PAGE) * PAGE
        ranges = []
        for col in self.layout.columns:
            extent = col.max_length * col.step_bytes
            for slot in slots:
                start = col.slot_offset(slot)
                ranges.append((start - start % PAGE, min(end_of_map, -(-(start + extent) // PAGE) * PAGE)))
        ranges.sort()
        merged = [list(ranges[0])]
        for start, end in ranges[1:]:
            if start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            if end > start:
                self._madvise(self._address + start, end - start, MADV_POPULATE_READ)

    def write(self, slot: int, columns: Sequence[Sequence[np.ndarray]]) -> None:
        """Copy an item's rows (per column, pieces of ``[t, *shape]``, concatenated) into ``slot``."""
        for view, pieces in zip(self.views, columns, strict=True):
            t = 0
            for piece in pieces:
                n = piece.shape[0]
                view[slot, t:t + n] = piece
                t += n

    remote = False

    def rows(self, slot: int, lengths: Sequence[int]) -> list[np.ndarray]:
        """A copy of the slot's first ``lengths[c]`` steps per column."""
        return [np.array(view[slot, :n]) for view, n in zip(self.views, lengths, strict=True)]

    def forget(self, slot: int) -> None:
        """Nothing kept per slot here (the rows live in the segment)."""

    def copy_slot_to(self, other: SegmentWriterMapping, slot: int, lengths: Sequence[int]) -> None:
        """Copy a slot's first ``lengths[c]`` steps per column into the same slot of another version."""
        for src, dst, n in zip(self.views, other.views, lengths, strict=True):
            dst[slot, :n] = src[slot, :n]


@dataclass
class _Table:
    """What the writer knows of one table: its newest mapping and the slots it holds."""

    name: str
    mapping: SegmentWriterMapping | None = None
    structure: bytes = b""  # the layout's serialized structure, to compare items with
    pool: deque = field(default_factory=deque)  # (slot, use_by)
    reserving: bool = False
    no_layout_until: float = 0.0  # the daemon had no layout: ask again after this
    mappings: dict[int, SegmentWriterMapping] = field(default_factory=dict)  # versions still referenced


@dataclass
class UncommittedItem:
    """An item written into a slot whose commit did not come back (read back from the writer's mapping)."""

    table: str
    key: int
    priority: float
    columns: list[np.ndarray]  # per column [length, *shape] (squeezed: one step)
    squeeze: list[bool]
    structure: bytes  # the layout's serialized Structure
    episode_ids: list[int]


@dataclass
class _Commit:
    table: str
    version: int
    items: list[pb.CommitItem]


class SlotWriter:
    """One InsertPlane stream (see the module docstring). Thread safe for one writing thread."""

    def __init__(self, channel: grpc.Channel, *, reserve_ahead: int = DEFAULT_RESERVE_AHEAD,
                 open_timeout: float | None = 30.0, metadata: Sequence[tuple[str, str]] | None = None,
                 answer_timeout: float | None = 30.0, address: str = "the daemon",
                 stream_host: str | None = None, stream_ssl: Callable[[str], Any] | None = None):
        """``answer_timeout``: seconds without any answer from the daemon (stream or probe) before the stream
        fails with DaemonNotAnswering (None: wait for ever); ``address`` names the daemon in messages.
        ``stream_host``: this writer is on another host; its rows go on a stream connection to that host
        (``gear_contract.stream_rows``; ``stream_ssl(host)`` gives the TLS context when the daemon asks for TLS)."""
        self._reserve_ahead = max(1, int(reserve_ahead))
        self._sender: Any = None  # stream_rows.RowSender of a remote writer
        self._stream_endpoint: pb.StreamEndpoint | None = None
        self._writing: dict[int, tuple[str, int, pb.CommitItem]] = {}  # remote: key -> rows on their way
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._sent: deque = deque()  # (request id, kind, payload, sent at) in send order: answered in order
        self._tables: dict[str, _Table] = {}
        self._commits: deque[_Commit] = deque()  # queued, not sent
        self._commit_in_flight: _Commit | None = None
        self.pending: dict[int, int] = {}  # key -> bytes, until committed
        self.in_flight_bytes = 0
        self.error: BaseException | None = None
        self.done = False
        self._timeout_s = 60.0
        self._max_reservations = 1 << 30
        self._opened = threading.Event()
        self._answered = 0  # id of the last answered request
        self._answered_at = time.monotonic()
        self.address = address
        self._watch = DaemonWatch(channel, answer_timeout, metadata)
        self._to_populate: list[tuple[SegmentWriterMapping, list[int]]] = []  # reader thread's, outside the lock
        call = channel.stream_stream(INSERT_PLANE_METHOD, request_serializer=pb.InsertPlaneRequest.SerializeToString,
                                     response_deserializer=pb.InsertPlaneResponse.FromString)
        self._call = call(self._requests(), wait_for_ready=True, metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="gear-insert-plane", daemon=True)
        self._reader.start()
        self._send(pb.InsertPlaneRequest(open=pb.InsertPlaneOpen(host_id=local_host_id(), pid=os.getpid(),
                                                                 stream=stream_host is not None)), "open", None)
        if not self._opened.wait(open_timeout) or self.error is not None:
            error = self.error
            self.abort()
            if isinstance(error, grpc.RpcError) and error.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                                     grpc.StatusCode.UNIMPLEMENTED):
                raise InsertPlaneUnavailable(error.details() or str(error.code())) from error
            if error is not None:
                raise error
            raise OpenTimedOut(f"the daemon did not open the insert plane within {open_timeout} s")
        if stream_host is not None:
            from gear_contract.stream_rows import RowSender

            endpoint = self._stream_endpoint
            try:
                if endpoint is None:
                    raise InsertPlaneUnavailable("the daemon answered without a stream endpoint (an older daemon)")
                context = stream_ssl(endpoint.host or stream_host) if endpoint.tls and stream_ssl else None
                if endpoint.tls and context is None:
                    raise InsertPlaneUnavailable("the daemon's insert stream speaks TLS; no TLS settings given")
                self._sender = RowSender(stream_host, endpoint, context)
            except (OSError, ValueError, InsertPlaneUnavailable) as exc:
                self.abort()
                if isinstance(exc, InsertPlaneUnavailable):
                    raise
                raise InsertPlaneUnavailable(f"cannot open the insert stream's row connection: {exc}") from exc

    # ------------------------------------------------------------------ stream plumbing
    def _requests(self) -> Iterator[pb.InsertPlaneRequest]:
        while True:
            request = self._queue.get()
            if request is None:
                return
            yield request

    def _send(self, request: pb.InsertPlaneRequest, kind: str, payload: object) -> None:
        """Queue a request (lock held or not: the queue orders it; ``_sent`` mirrors the order)."""
        request.request_id = next(self._ids)
        self._sent.append((request.request_id, kind, payload, time.monotonic()))
        self._queue.put(request)

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            for response in self._call:
                with self._cond:
                    request_id, kind, payload, _ = self._sent.popleft()
                    if response.request_id != request_id:
                        raise RuntimeError(f"insert plane answer {response.request_id} for request {request_id}")
                    self._answered = request_id
                    self._answered_at = time.monotonic()
                    if kind == "open":
                        if response.opened.HasField("stream"):
                            self._stream_endpoint = response.opened.stream
                        self._timeout_s = response.opened.reservation_timeout_ms / 1000.0
                        self._max_reservations = response.opened.max_reservations
                        self._opened.set()
                    elif kind == "reserve":
                        self._on_reserved(response.reserved, payload)
                    elif kind == "commit":
                        self._on_committed(response.committed, payload)
                    self._cond.notify_all()
                    jobs, self._to_populate = self._to_populate, []
                for mapping, slots in jobs:
                    mapping.populate(slots)
        except grpc.RpcError as e:
            error = e
        except BaseException as e:  # noqa: BLE001 - reported to the writer, never lost
            error = e
        finally:
            self._queue.put(None)
            with self._cond:
                if error is None and self.pending:
                    error = RuntimeError(f"the insert plane stream ended with {len(self.pending)} items uncommitted")
                if error is not None and self.error is None:
                    self.error = error
                self.done = True
                self._opened.set()
                self._cond.notify_all()

    def _await_answer(self, deadline: float | None = None) -> None:
        """Wait (lock held) for the daemon's next answer, at most until ``deadline``; when the daemon has
        answered nothing for the answer timeout, fail the stream instead (``error``, and the call cancelled)."""
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._sent and self.error is None:
            quiet_since = max(self._answered_at, self._sent[0][3])
            if self._watch.away(quiet_since):
                self.error = DaemonNotAnswering(
                    f"the daemon at {self.address} answered nothing for {self._watch.timeout_s:g} s (neither the "
                    "insert plane's stream nor a ServerInfo call)", self.address)
                self._queue.put(None)
                self._call.cancel()
                self._cond.notify_all()
                return
            recheck = self._watch.recheck_in(quiet_since)
            if recheck is not None:
                wait = recheck if wait is None else min(wait, recheck)
        self._cond.wait(wait)

    # ------------------------------------------------------------------ layouts and reservations
    def _adopt(self, state: _Table, layout_msg: pb.TableLayout) -> bool:
        """Map a newer layout's segment; False when the table already left it (its file is gone)."""
        layout = TableLayout.from_proto(layout_msg)
        if state.mapping is not None and state.mapping.layout.version >= layout.version:
            return True
        if self._sender is not None:
            from gear_contract.stream_rows import StreamSlotMapping

            mapping: Any = StreamSlotMapping(layout, self._sender, state.name)
        else:
            try:
                mapping = SegmentWriterMapping(layout)
            except SegmentGone:
                return False
        state.mapping = mapping
        state.mappings[layout.version] = mapping
        state.structure = layout.structure.SerializeToString()
        return True

    def _on_reserved(self, reserved: pb.SlotsReserved, sent_at: float) -> None:
        state = self._tables[reserved.table]
        state.reserving = False
        if not reserved.slots:
            state.no_layout_until = time.monotonic() + 0.002  # ask again soon: an InsertStream item may fix it
            return
        use_by = sent_at + self._timeout_s / 2
        state.pool.extend((int(s), use_by) for s in reserved.slots)  # slot numbers hold in every version
        if reserved.HasField("layout") and not self._adopt(state, reserved.layout):
            # The table grew again before the segment was opened: one more slot brings the newest layout.
            state.reserving = True
            self._send(pb.InsertPlaneRequest(reserve=pb.ReserveSlots(table=state.name, count=1)), "reserve",
                       time.monotonic())
        self._plan_populate(state)

    def _plan_populate(self, state: _Table) -> None:
        """Have the reader map the pages of the table's reserved slots not yet mapped in its newest
        mapping (a new version maps them afresh) before the writer copies there (lock held)."""
        if state.mapping is not None and state.pool:
            slots = state.mapping.claim([s for s, _ in state.pool])
            if slots:
                self._to_populate.append((state.mapping, slots))

    def _on_committed(self, committed: pb.SlotsCommitted, batch: _Commit) -> None:
        self._commit_in_flight = None
        done = len(committed.keys)
        for key in committed.keys:
            self.in_flight_bytes -= self.pending.pop(key, 0)
        state = self._tables[batch.table]
        sent = state.mappings.get(batch.version)
        if sent is not None:
            for item in batch.items[:done]:
                sent.forget(item.slot)
        if done < len(batch.items) and not committed.HasField("layout"):
            raise RuntimeError(f"insert plane: {len(batch.items) - done} items of table '{batch.table}' were not "
                               "committed and no new layout came with the answer")
        if done < len(batch.items):  # the table moved to a new segment: carry the rows over, commit again
            rest = batch.items[done:]
            if self._adopt(state, committed.layout):
                old, new = state.mappings[batch.version], state.mapping
                if new.remote:  # send the rows again, into the new segment; each is committed once it is in
                    for item in rest:
                        rows = old.rows(item.slot, item.lengths)
                        old.forget(item.slot)
                        self._send_rows(batch.table, new, item, [[r] for r in rows])
                else:
                    for item in rest:
                        old.copy_slot_to(new, item.slot, item.lengths)
                    self._commits.appendleft(_Commit(batch.table, new.layout.version, rest))
                self._plan_populate(state)
            else:  # that segment is gone too: the same commit again brings the newest layout
                self._commits.appendleft(_Commit(batch.table, batch.version, rest))
        self._send_commit()
        referenced = {c.version for c in self._commits if c.table == batch.table}
        referenced.update(version for table, version, _ in self._writing.values() if table == batch.table)
        if self._commit_in_flight is not None and self._commit_in_flight.table == batch.table:
            referenced.add(self._commit_in_flight.version)
        current = state.mapping.layout.version if state.mapping is not None else -1
        for version in [v for v in state.mappings if v != current and v not in referenced]:
            del state.mappings[version]  # unmapped once the last view of it is gone

    def _held(self) -> int:
        held = sum(len(t.pool) for t in self._tables.values()) + len(self.pending)
        return held

    def _maybe_reserve(self, state: _Table) -> None:
        """Ask for more slots when the pool runs low (lock held)."""
        if state.reserving or len(state.pool) > self._reserve_ahead // 2:
            return
        if state.mapping is None and time.monotonic() < state.no_layout_until:
            return
        count = min(self._reserve_ahead - len(state.pool), self._max_reservations - self._held())
        if count < 1:
            return
        state.reserving = True
        self._send(pb.InsertPlaneRequest(reserve=pb.ReserveSlots(table=state.name, count=count)), "reserve",
                   time.monotonic())

    def _send_commit(self) -> None:
        """Send the queued commits of one table and version as one request if none is in flight (lock held).

        A remote writer holds its commits back while rows are still on their way and fewer than
        ``REMOTE_COMMIT_BATCH`` items wait: each commit costs the daemon's event loop a message, which
        one per item made the daemon's CPU, not the link, bound a remote actor. The last rows answer
        (or a failed connection, which answers them all) sends what waits, so nothing is held for good.
        """
        if self._commit_in_flight is not None or not self._commits:
            return
        if self._writing and sum(len(c.items) for c in self._commits) < REMOTE_COMMIT_BATCH:
            return
        first = self._commits.popleft()
        while (self._commits and self._commits[0].table == first.table and self._commits[0].version == first.version
               and len(first.items) < MAX_COMMIT_BATCH):
            first.items.extend(self._commits.popleft().items)
        self._commit_in_flight = first
        self._send(pb.InsertPlaneRequest(commit=pb.CommitSlots(table=first.table, layout_version=first.version,
                                                               items=first.items)), "commit", first)

    # ------------------------------------------------------------------ the writer's API
    def fits(self, table: str, specs: Sequence[tuple[np.dtype, tuple, bool]], lengths: Sequence[int],
             structure: bytes) -> bool:
        """Whether an item (per column dtype, step shape, squeeze; lengths; serialized structure) can be
        written into a slot now. The first call for a table waits for its layout (one round trip; a table
        without one yet is asked again at the next call). When the item does not fit, the table's unused
        reservations are given back first (the InsertStream insert may make the table relearn its layout)."""
        with self._cond:
            self._raise_error()
            state = self._tables.get(table)
            if state is None:
                state = self._tables[table] = _Table(table)
            if state.mapping is None:  # learn the layout first (one round trip)
                self._maybe_reserve(state)
                while state.reserving and not self.done and self.error is None:
                    self._await_answer()
                self._raise_error()
                if state.mapping is None:
                    return False
            if self._fits_layout(state.mapping.layout, state.structure, specs, lengths, structure):
                return True
            if state.pool:  # the item goes over InsertStream: it may make the table relearn or grow
                self._cancel_pool(state, wait=True)
            return False

    @staticmethod
    def _fits_layout(layout: TableLayout, layout_structure: bytes, specs: Sequence[tuple[np.dtype, tuple, bool]],
                     lengths: Sequence[int], structure: bytes) -> bool:
        if structure != layout_structure or len(specs) != len(layout.columns):
            return False
        for (dtype, shape, squeeze), n, col in zip(specs, lengths, layout.columns, strict=True):
            if squeeze != col.squeeze or dtype != col.dtype or tuple(shape) != col.shape or n > col.max_length:
                return False
        return True

    def _cancel_pool(self, state: _Table, wait: bool) -> None:
        """Give a table's unused reservations back (a table does not relearn while slots are reserved);
        with ``wait``, until the daemon has them (lock held)."""
        slots = [s for s, _ in state.pool]
        state.pool.clear()
        self._send(pb.InsertPlaneRequest(cancel=pb.CancelSlots(table=state.name, slots=slots)), "cancel", None)
        request_id = self._sent[-1][0]
        while wait and not self.done and self.error is None and self._answered < request_id:
            self._await_answer()

    def write(self, table: str, key: int, priority: float, columns: Sequence[Sequence[np.ndarray]],
              lengths: Sequence[int], episode_ids: Sequence[int] = (), timeout: float | None = None) -> None:
        """Copy an item that ``fits`` into a reserved slot and queue its commit (waits for a slot)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            state = self._tables[table]
            while True:
                self._raise_error()
                now = time.monotonic()
                expired = []
                while state.pool and state.pool[0][1] <= now:
                    expired.append(state.pool.popleft()[0])
                if expired:
                    self._send(pb.InsertPlaneRequest(cancel=pb.CancelSlots(table=table, slots=expired)), "cancel",
                               None)
                self._maybe_reserve(state)
                if state.pool:
                    break
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"no slot of table '{table}' reserved within {timeout} s")
                self._await_answer(deadline)
            slot = state.pool.popleft()[0]
            mapping = state.mapping
            self._maybe_reserve(state)
        nbytes = sum(p.nbytes for pieces in columns for p in pieces)
        item = pb.CommitItem(key=key, priority=priority, slot=slot, lengths=lengths, episode_ids=episode_ids)
        if mapping.remote:
            with self._cond:
                self.pending[key] = self.pending.get(key, 0) + nbytes
                self.in_flight_bytes += nbytes
                done = self._track_rows(table, mapping, item)
            try:  # outside the lock: commit answers go on while the rows are sent
                mapping.write_async(slot, columns, done)
            except ConnectionError as exc:
                with self._cond:
                    self._rows_failed(item, exc)
            return
        mapping.write(slot, columns)
        with self._cond:
            self.pending[key] = self.pending.get(key, 0) + nbytes
            self.in_flight_bytes += nbytes
            self._commits.append(_Commit(table, mapping.layout.version, [item]))
            self._send_commit()

    def _send_rows(self, table: str, mapping: Any, item: pb.CommitItem,
                   columns: Sequence[Sequence[np.ndarray]]) -> None:
        """Remote: send an item's rows on the row connection (lock held); see ``_track_rows``."""
        done = self._track_rows(table, mapping, item)
        try:
            mapping.write_async(item.slot, columns, done)
        except ConnectionError as exc:
            self._rows_failed(item, exc)

    def _rows_failed(self, item: pb.CommitItem, exc: BaseException) -> None:
        """The row connection failed before ``item``'s rows went out (lock held): the writer sees the error."""
        self._writing.pop(item.key, None)
        if self.error is None:
            self.error = exc
        self._cond.notify_all()

    def _track_rows(self, table: str, mapping: Any, item: pb.CommitItem) -> Callable[[bool, str], None]:
        """Remote: note an item whose rows go out now (lock held); the callback, called on the row
        connection's reader thread once the daemon answered, queues its commit (or records the failure)."""
        version = mapping.layout.version
        self._writing[item.key] = (table, version, item)

        def done(status: int, message: str) -> None:
            from gear_contract import stream_frames as frames

            with self._cond:
                if self._writing.pop(item.key, None) is None:
                    return
                # LAYOUT_GONE: the table moved to a newer layout before the rows went in; the commit under
                # the old version comes back with the new layout and the rows are sent again (_on_committed)
                if status in (frames.OK, frames.LAYOUT_GONE):
                    self._commits.append(_Commit(table, version, [item]))
                    self._send_commit()
                elif self.error is None:
                    self.error = RuntimeError(f"the daemon did not take the rows of item {item.key}: {message}")
                self._cond.notify_all()

        return done

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def uncommitted(self) -> list[UncommittedItem]:
        """The items written whose commits were not acknowledged, oldest first, their rows copied out of
        the mappings (a stream that failed leaves them to be sent another way; keys are idempotent)."""
        with self._cond:
            batches = ([self._commit_in_flight] if self._commit_in_flight is not None else []) + list(self._commits)
            batches += [_Commit(table, version, [item]) for table, version, item in self._writing.values()]
            out = []
            for batch in batches:
                mapping = self._tables[batch.table].mappings[batch.version]
                columns = mapping.layout.columns
                structure = mapping.layout.structure.SerializeToString()
                for item in batch.items:
                    if item.key not in self.pending:
                        continue
                    rows = mapping.rows(item.slot, item.lengths)
                    out.append(UncommittedItem(batch.table, item.key, item.priority, rows, [c.squeeze for c in columns],
                                               structure, list(item.episode_ids)))
            return out

    def wait(self, max_items: int, max_bytes: int = 1 << 62, deadline: float | None = None) -> bool:
        """Block until at most max_items (and max_bytes) are uncommitted; False on timeout.

        Returns early when the stream failed (the caller checks ``error``).
        """
        with self._cond:
            while len(self.pending) > max_items or (self.pending and self.in_flight_bytes > max_bytes):
                if self.done or self.error is not None:
                    return True
                if deadline is not None and deadline <= time.monotonic():
                    return False
                self._await_answer(deadline)
            return True

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error
        if self.done:
            raise RuntimeError("the insert plane stream is closed")

    def close(self, timeout: float = 2.0) -> None:
        """Give the unused reservations back, then end the stream."""
        with self._cond:
            deadline = time.monotonic() + timeout
            while (not self.done and any(t.reserving for t in self._tables.values())
                   and time.monotonic() < deadline):
                self._cond.wait(deadline - time.monotonic())  # slots still on their way are given back too
            if not self.done:
                for state in self._tables.values():
                    if state.pool:
                        self._cancel_pool(state, wait=False)
        self._queue.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            self.abort()
            self._reader.join(timeout)
        if self._sender is not None:
            self._sender.close()

    def abort(self) -> None:
        """End the stream at once (its reservations are given back by the daemon)."""
        self._queue.put(None)
        self._call.cancel()
        if self._sender is not None:
            self._sender.close()
