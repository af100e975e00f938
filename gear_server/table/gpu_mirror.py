"""A table's GPU-memory tier: its most recent items' rows kept in one GPU's memory.

The mirror holds ``budget // row_bytes`` rows (the row is the segment's slot
row, ``row_layout``; at most ``max_size + spare``), in one buffer allocated at the budget when the table is
created, so a GPU that cannot hold it is refused at start. Committed items are
queued (``committed``, under the table's lock: an append); a mirror thread
takes them in batches, gives each a row (a free one, else the row of the oldest
mirrored item no lease holds) and copies the slot's bytes from the host segment
with ``cudaMemcpyAsync``, off the insert path. The bookkeeping is NumPy: per
row the slot it mirrors and that slot's generation when copied (0 while the row
is being written or free), per slot its row.

Torn reads are impossible: a row is marked with its item's generation only
after the copy, and only if the slot still holds that generation (an insert
bumps it before writing the slot); a row whose slot is leased is never chosen
for rewriting; ``rows_for`` (called after the Select's lease is taken) lists a
row only when it holds exactly the selected slot and generation, so a listed
row stays intact for the lease's life. Items not listed are read from the
segment as on the shm plane.

Backends: ``cuda`` (CuPy; learners open the buffer through CUDA IPC) and
``host`` (a ``/dev/shm`` file standing in for the device buffer, for machines
without a GPU: the same bookkeeping, copies and learner reads in host memory).
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gear_contract._proto import replay_pb2 as pb


class MirroredTable(Protocol):
    """What a mirror reads of the table that owns it (the table's core): no import of the core, no circle."""

    name: str
    max_size: int
    spare: int
    lock: Any  # the table's lock: the mirror's hooks run under it, its copy thread takes it
    columns: Any  # the table's ColumnStore (its layout)

    @property
    def meta(self) -> Any: ...  # the table's ItemMetadata (leases, generations)

    @property
    def capacity(self) -> int: ...


log = logging.getLogger(__name__)

BACKENDS = ("cuda", "host")
# Items the thread copies per batch at most (one lock round and one stream synchronisation each).
MAX_BATCH_ITEMS = 256
# Oldest rows looked at for one eviction: leased ones are skipped, so under heavy leasing the scan is bounded.
MAX_EVICTION_SCAN = 1024


class MirrorRefused(ValueError):
    """The GPU mirror cannot be set up as configured (no GPU, not enough free memory, bad budget)."""


@dataclass(frozen=True)
class MirrorSpec:
    """Where a table is mirrored: GPU ``device``, ``budget_bytes`` of its memory, ``backend``."""

    device: int
    budget_bytes: int
    backend: str = "cuda"

    @classmethod
    def from_proto(cls, config: pb.GpuMirror, table: str) -> MirrorSpec:
        """Validated spec of a ``TableConfig.gpu_mirror`` (MirrorRefused naming the table and the problem)."""
        backend = config.backend or "cuda"
        if backend not in BACKENDS:
            raise MirrorRefused(f"table '{table}': gpu_mirror backend must be one of {list(BACKENDS)}, got {backend!r}")
        if config.device < 0:
            raise MirrorRefused(f"table '{table}': gpu_mirror device must be >= 0, got {config.device}")
        if config.bytes <= 0:
            raise MirrorRefused(f"table '{table}': gpu_mirror bytes must be > 0, got {config.bytes}")
        return cls(int(config.device), int(config.bytes), backend)


class HostRows:
    """The host stand-in for the device buffer: a 0600 file under ``shm_dir`` that learners map read-only."""

    def __init__(self, nbytes: int, path: str):
        self.path = path
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.nbytes = nbytes
        self.array = np.frombuffer(self._mmap, np.uint8)

    def write(self, source: np.ndarray, pairs: list[tuple[int, int]], row_bytes: int) -> None:
        """Copy ``source`` rows (byte row ``slot``) into mirror rows, for each ``(slot, row)``."""
        src = source[: (len(source) // row_bytes) * row_bytes].reshape(-1, row_bytes)
        dst = self.array[: (self.nbytes // row_bytes) * row_bytes].reshape(-1, row_bytes)
        slots = np.fromiter((s for s, _ in pairs), np.int64, len(pairs))
        rows = np.fromiter((r for _, r in pairs), np.int64, len(pairs))
        dst[rows] = src[slots]

    def describe(self, device: int) -> pb.DeviceTier:
        return pb.DeviceTier(device=device, nbytes=self.nbytes, host_path=self.path)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.array = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it


class CudaRows:
    """The mirror's buffer in GPU ``device``'s memory (one cudaMalloc, exported through CUDA IPC)."""

    def __init__(self, nbytes: int, device: int, table: str):
        from gear_kernels.backend import cupy_module

        cp = cupy_module()
        if cp is None:
            raise MirrorRefused(f"table '{table}': gpu_mirror needs CuPy and a CUDA GPU on the daemon's host, and "
                                "none is usable here")
        self._cp = cp
        self.device = device
        self.nbytes = nbytes
        count = cp.cuda.runtime.getDeviceCount()
        if device >= count:
            raise MirrorRefused(f"table '{table}': gpu_mirror device {device} does not exist ({count} GPU(s))")
        with cp.cuda.Device(device):
            free, total = cp.cuda.runtime.memGetInfo()
            if nbytes > free:
                raise MirrorRefused(f"table '{table}': gpu_mirror needs {nbytes} bytes on GPU {device}, which has "
                                    f"{free} free of {total}; lower gpu_mirror bytes")
            self._memory = cp.cuda.Memory(nbytes)  # its own cudaMalloc: an IPC handle addresses its start
            self.ptr = int(self._memory.ptr)
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.ptr))
        self._registration: Any = None
        self._registered: tuple[int, int] | None = None

    def _source_ptr(self, source: np.ndarray) -> int:
        """The segment's address, registered (pinned) so copies run as DMA; pageable if that fails."""
        key = (int(source.ctypes.data), int(source.nbytes))
        if self._registered != key:
            self._unregister()
            try:
                from gear_kernels import HostRegistration

                self._registration = HostRegistration(source, read_only=False)
            except Exception as exc:  # noqa: BLE001 - pageable copies still work
                log.warning("GPU mirror: registering the segment failed (%s); copying from pageable memory", exc)
            self._registered = key
        return key[0]

    def write(self, source: np.ndarray, pairs: list[tuple[int, int]], row_bytes: int) -> None:
        """One cudaMemcpyAsync per ``(slot, row)`` on the mirror's stream, then wait for them."""
        cp = self._cp
        with cp.cuda.Device(self.device):
            src = self._source_ptr(source)
            for slot, row in pairs:
                cp.cuda.runtime.memcpyAsync(self.ptr + row * row_bytes, src + slot * row_bytes, row_bytes,
                                            cp.cuda.runtime.memcpyDefault, self.stream.ptr)
            self.stream.synchronize()

    def describe(self, device: int) -> pb.DeviceTier:
        return pb.DeviceTier(device=device, nbytes=self.nbytes, ipc_handle=self.handle)

    def device_array(self) -> Any:
        """The whole buffer as a CuPy uint8 array on the mirror's GPU (no copy)."""
        cp = self._cp
        return cp.ndarray((self.nbytes,), cp.uint8, cp.cuda.MemoryPointer(self._memory, 0))

    def _unregister(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        self._registered = None

    def close(self) -> None:
        with self._cp.cuda.Device(self.device):
            self.stream.synchronize()
            self._unregister()
            self._memory = None


class GpuMirror:
    """The bookkeeping and upkeep of one table's GPU mirror (see module docstring)."""

    def __init__(self, state: MirroredTable, spec: MirrorSpec, host_path: str):
        self._st = state
        self.spec = spec
        if spec.backend == "cuda":
            self.rows_buffer: HostRows | CudaRows = CudaRows(spec.budget_bytes, spec.device, state.name)
        else:
            self.rows_buffer = HostRows(spec.budget_bytes, host_path)
        self._lock = threading.Lock()  # the row maps; taken inside the table's lock, never around it
        self._wake = threading.Condition(threading.Lock())
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        self._stopped = False
        self._busy = False  # the thread is copying a batch
        self.row_bytes = 0
        self.num_rows = 0
        self.row_slot = np.zeros(0, np.int64)
        self.row_generation = np.zeros(0, np.uint64)  # 0: free or being written
        self.slot_row = np.zeros(0, np.int64)
        self._order: collections.OrderedDict[int, None] = collections.OrderedDict()  # used rows, oldest first
        self._free: list[int] = []
        self.copied_items = 0
        self._thread = threading.Thread(target=self._run, name=f"gear-mirror-{state.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ hooks (table lock held)
    def committed(self, slot: int, generation: int) -> None:
        """An item was published in ``slot``: queue it for copying (only as many of the newest as rows fit)."""
        layout = self._st.columns.layout
        fit = self.spec.budget_bytes // layout.columns[0].slot_stride if layout is not None and layout.columns else 0
        with self._wake:
            self._pending.append((slot, generation))
            if len(self._pending) > max(fit, MAX_BATCH_ITEMS):
                self._pending.popleft()  # older than every row could hold (those are read from the segment)
            self._wake.notify_all()

    def committed_many(self, slots: np.ndarray, generations: np.ndarray) -> None:
        """Items already in ``slots`` (oldest first; a restored table's): queue the newest that fit the rows."""
        layout = self._st.columns.layout
        fit = self.spec.budget_bytes // layout.columns[0].slot_stride if layout is not None and layout.columns else 0
        keep = max(fit, MAX_BATCH_ITEMS)
        with self._wake:
            self._pending.extend(zip(slots[-keep:].tolist(), generations[-keep:].tolist(), strict=True))
            while len(self._pending) > keep:
                self._pending.popleft()
            self._wake.notify_all()

    def removed(self, slot: int) -> None:
        """The item in ``slot`` went: free its row unless a lease still holds the slot."""
        with self._lock:
            if slot >= len(self.slot_row):
                return
            row = int(self.slot_row[slot])
            if row >= 0 and self._st.meta.leases[slot] == 0:
                self._free_row(row)

    def clear(self) -> None:
        """Free every row no lease holds (reset; restore, whose slots' generations may repeat, has no leases)."""
        with self._wake:
            self._pending.clear()
        with self._lock:
            leases = self._st.meta.leases
            for row in list(self._order):
                slot = int(self.row_slot[row])
                if slot < 0 or slot >= len(leases) or leases[slot] == 0:
                    self._free_row(row)

    # ------------------------------------------------------------------ reads
    def rows_for(self, slots: np.ndarray, generations: np.ndarray, row_bytes: int) -> np.ndarray:
        """Each selected item's mirror row, -1 where the mirror does not hold that slot's ``generation``.

        Call it after the selection's lease is taken: a row it lists is then not rewritten while the lease holds.
        ``row_bytes``: the selection's layout row size (another size: nothing is listed).
        """
        slots = np.asarray(slots, np.int64)
        out = np.full(len(slots), -1, np.int64)
        with self._lock:
            if row_bytes != self.row_bytes or not self.num_rows or not len(slots):
                return out
            inside = slots < len(self.slot_row)
            rows = np.where(inside, self.slot_row[np.where(inside, slots, 0)], -1)
            known = rows >= 0
            r = np.where(known, rows, 0)
            ok = known & (self.row_slot[r] == slots) & (self.row_generation[r] == np.asarray(generations, np.uint64))
            out[ok] = rows[ok]
        return out

    def describe(self) -> pb.DeviceTier:
        """What a learner needs to open the buffer (OpenDataPlaneResponse.device_tier)."""
        return self.rows_buffer.describe(self.spec.device)

    def info(self) -> pb.GpuMirrorInfo:
        with self._lock:
            mirrored = int(np.count_nonzero(self.row_generation))
            return pb.GpuMirrorInfo(device=self.spec.device, budget_bytes=self.spec.budget_bytes, rows=self.num_rows,
                                    mirrored_items=mirrored, copied_items=self.copied_items)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every item committed so far was copied (or skipped); False if ``timeout`` passed first."""
        with self._wake:
            return self._wake.wait_for(lambda: self._stopped or (not self._pending and not self._busy), timeout)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the thread and free the buffer. Idempotent."""
        with self._wake:
            if self._stopped:
                return
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.rows_buffer.close()

    # ------------------------------------------------------------------ internals (self._lock held)
    def _set_rows(self, row_bytes: int) -> None:
        """Lay the buffer out in rows of ``row_bytes`` (every row free): as many as the budget holds, at most
        ``max_size + spare`` (the slots a table holds but while leases pin deleted items)."""
        self.row_bytes = row_bytes
        fit = self.spec.budget_bytes // row_bytes if row_bytes else 0
        self.num_rows = min(fit, self._st.max_size + self._st.spare)
        self.row_slot = np.full(self.num_rows, -1, np.int64)
        self.row_generation = np.zeros(self.num_rows, np.uint64)
        self.slot_row = np.full(len(self.slot_row), -1, np.int64)
        self._order.clear()
        self._free = list(range(self.num_rows - 1, -1, -1))

    def _free_row(self, row: int) -> None:
        slot = int(self.row_slot[row])
        if slot >= 0 and self.slot_row[slot] == row:
            self.slot_row[slot] = -1
        self.row_slot[row] = -1
        self.row_generation[row] = 0
        self._order.pop(row, None)
        self._free.append(row)

    def _take_row(self, leases: np.ndarray) -> int:
        """A free row, else the oldest mirrored one whose slot no lease holds (-1: none within the scan)."""
        if self._free:
            return self._free.pop()
        for i, row in enumerate(self._order):
            if i >= MAX_EVICTION_SCAN:
                break
            slot = int(self.row_slot[row])
            if slot < 0 or slot >= len(leases) or leases[slot] == 0:
                self._free_row(row)
                return self._free.pop()
        return -1

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._wake:
                self._busy = False
                self._wake.notify_all()
                while not self._pending and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), MAX_BATCH_ITEMS))]
                self._busy = True
            try:
                self._copy(batch)
            except Exception:  # noqa: BLE001 - the thread must survive; those items are read from the segment
                log.exception("GPU mirror of table '%s': copying %d item(s) failed", self._st.name, len(batch))

    def _copy(self, batch: list[tuple[int, int]]) -> None:
        st = self._st
        with st.lock:
            layout = st.columns.layout
            segment = st.columns.segment
            if layout is None or segment is None or segment.closed:
                return
            row_bytes = layout.columns[0].slot_stride if layout.columns else 0
            meta = st.meta
            pairs: list[tuple[int, int, int]] = []
            with self._lock:
                if row_bytes != self.row_bytes:
                    self._set_rows(row_bytes)
                if len(self.slot_row) < st.capacity:
                    grown = np.full(st.capacity, -1, np.int64)
                    grown[: len(self.slot_row)] = self.slot_row
                    self.slot_row = grown
                for slot, generation in batch[-self.num_rows:] if self.num_rows else ():
                    if not meta.valid[slot] or int(meta.generation[slot]) != generation:
                        continue  # gone or rewritten since its commit
                    old = int(self.slot_row[slot])
                    if old >= 0 and self.row_slot[old] == slot:
                        if self.row_generation[old] == generation:
                            continue  # already mirrored
                        if meta.leases[slot] == 0:
                            self._free_row(old)
                        else:
                            continue
                    row = self._take_row(meta.leases)
                    if row < 0:
                        break  # every row is leased: these items are read from the segment
                    self.row_slot[row] = slot
                    self.row_generation[row] = 0  # being written: no reader is given it
                    self.slot_row[slot] = row
                    self._order[row] = None
                    pairs.append((slot, row, generation))
            source = np.frombuffer(segment.buffer, np.uint8)  # holds the mapping while we copy from it
        if not pairs:
            return
        self.rows_buffer.write(source, [(s, r) for s, r, _ in pairs], row_bytes)
        del source
        with st.lock, self._lock:
            if row_bytes != self.row_bytes:
                return  # relaid meanwhile: these rows were dropped
            meta = st.meta  # (growth replaces the arrays, keeping their values; reset and restore clear the rows)
            for slot, row, generation in pairs:
                if self.row_slot[row] != slot:
                    continue
                if meta.valid[slot] and int(meta.generation[slot]) == generation:
                    self.row_generation[row] = generation
                    self.copied_items += 1
                else:  # rewritten (or the table's slots were rebuilt) while we copied: not trustworthy
                    self._free_row(row)
