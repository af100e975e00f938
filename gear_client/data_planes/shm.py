"""The shm plane: a learner on the daemon's host reads the table segment directly.

The segment (a 0600 file under /dev/shm) is mapped read-only. On the CPU a
batch is gathered with NumPy into a host buffer: one ``memcpy`` per item and
column for large items, one vectorised ``take`` per column for small ones. On a
GPU the mapping is registered with CUDA (``cudaHostRegister``, mapped) and the
collection kernel of ``gear_kernels`` reads the items straight into device
memory. Nothing crosses a socket but the selection.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gear_client.data_planes.batch import BufferPool, Pending, SampledBatch, column_arrays
from gear_client.data_planes.projection import ColumnChoice, narrowed
from gear_client.data_planes.range_planning import (
    LENGTH,
    LOCAL,
    REMOTE,
    BatchLayout,
    WindowSpec,
    padding_ranges,
    plan_ranges,
    resolve_windows,
    window_bounds,
    window_steps,
)
from gear_contract.layout import ColumnLayout, TableLayout

# Item bytes from which one memcpy per item beats a vectorised take (measured on x86-64).
MEMCPY_ITEM_BYTES = 16 << 10
# GPU: CUDA streams the gathers of successive batches take turns on, so that one batch's inputs
# upload and its kernel starts while the previous kernel still runs. They are non-blocking streams:
# nothing on the legacy default stream (a learner's own work, a sharded batch's assembly) waits for
# the gathers read ahead, nor they for it, except that each gather first waits (an event, no host
# wait) for the work already queued on the launching thread's current stream: a batch's memory the
# learner dropped is never rewritten while work it queued before still reads it.
GPU_STREAMS = 4
# A host gather under these bytes runs in the caller's thread even when pipelined: handing it to the worker
# costs more (a thread wake-up, and the GIL handed back and forth) than copying it (a batch of 4096 keys).
WORKER_MIN_BYTES = 1 << 20
# Segments up to this size are mapped with MAP_POPULATE (page-table entries made at open, about
# 0.1 s per GiB, instead of minor faults during the first batches).
POPULATE_MAX_BYTES = 8 << 30


class SegmentMapping:
    """A read-only mapping of a table segment (PermissionError / FileNotFoundError if it cannot be opened)."""

    def __init__(self, layout: TableLayout):
        self.layout = layout
        fd = os.open(layout.segment, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < layout.segment_size:
                raise ValueError(f"segment {layout.segment} holds {size} bytes, the layout needs {layout.segment_size}")
            flags = mmap.MAP_SHARED
            if layout.segment_size <= POPULATE_MAX_BYTES:
                flags |= getattr(mmap, "MAP_POPULATE", 0)  # map every page now, not on first touch per batch
            self._mmap = mmap.mmap(fd, layout.segment_size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self._slot_views: dict[tuple[int, int, int], np.ndarray] = {}

    @property
    def buffer(self) -> mmap.mmap:
        return self._mmap

    @property
    def address(self) -> int:
        return int(self.bytes.ctypes.data)

    def slot_view(self, col: ColumnLayout, first_step: int, steps: int) -> np.ndarray:
        """``[capacity]`` array of ``V<steps * step_bytes>`` records: the slots' bytes of one column."""
        key = (col.offset, first_step, steps)
        view = self._slot_views.get(key)
        if view is None:
            view = np.ndarray((self.layout.capacity,), dtype=f"V{steps * col.step_bytes}", buffer=self.bytes,
                              offset=col.offset + first_step * col.step_bytes, strides=(col.slot_stride,))
            self._slot_views[key] = view
        return view

    def close(self) -> None:
        self._slot_views.clear()
        self.bytes = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a batch still views it (zero-copy users); unmapped with the last view


def gather_numpy(mapping: SegmentMapping, slots: np.ndarray, bounds: tuple[np.ndarray, np.ndarray, np.ndarray],
                 ranges: np.ndarray | None, batch: BatchLayout, out: np.ndarray,
                 layout: TableLayout | None = None) -> int:
    """Copy a selection into ``out`` (uint8, laid out as ``batch``), zeroing only the padding; returns the
    bytes read from the segment.

    ``layout``: the columns to read (the mapping's, or some of them: a column projection).

    ``bounds`` are window_bounds() (first source step, steps, first row step) and
    ``ranges`` the plan_ranges() of the selection, or None: planned here for the
    columns that need them. Small columns whose items all take the same steps go
    through one vectorised fancy-index read (never ``np.take``, which first copies
    the whole strided table view: milliseconds at 1M slots); the rest are one
    slice copy per range. (gear_kernels.gather_numpy gives the same bytes but
    zeroes whole rows first, a second pass over the batch.)
    """
    layout = layout or mapping.layout
    starts, counts, firsts = bounds
    n = len(slots)
    moved = 0
    if n and (slots.min() < 0 or slots.max() >= layout.capacity):
        raise ValueError(f"slot out of range [0, {layout.capacity})")
    done = np.zeros(len(layout.columns), dtype=bool)
    for c, (col, dst) in enumerate(zip(layout.columns, batch.columns, strict=True)):
        if n == 0:
            continue
        first, steps, at = int(starts[0, c]), int(counts[0, c]), int(firsts[0, c])
        record = steps * col.step_bytes
        uniform = (steps > 0 and bool(np.all(starts[:, c] == first)) and bool(np.all(counts[:, c] == steps))
                   and bool(np.all(firsts[:, c] == at)))
        if not uniform or record >= MEMCPY_ITEM_BYTES:
            continue
        picked = mapping.slot_view(col, first, steps)[slots]
        moved += n * record
        if dst.item_bytes == record:
            out[dst.offset:dst.offset + n * record].view(f"V{record}")[:] = picked
        else:
            rows = out[dst.offset:dst.offset + n * dst.item_bytes].reshape(n, dst.item_bytes)
            rows[:, at * col.step_bytes:at * col.step_bytes + record] = picked.view(np.uint8).reshape(n, record)
        done[c] = True
    if ranges is None:
        rest = np.flatnonzero(~done).tolist()
        if rest:
            moved += copy_ranges(mapping.bytes, out, plan_ranges(layout, slots, starts, counts, batch, firsts,
                                                                 columns=rest))
    elif len(ranges):
        moved += copy_ranges(mapping.bytes, out, ranges[~done[_column_of(ranges, batch)]])
    if n and not np.array_equal(counts, np.broadcast_to([dst.steps for dst in batch.columns], counts.shape)):
        for off, length in padding_ranges(counts, batch, firsts).tolist():  # rows shorter than the batch's
            out[off:off + length] = 0
    return moved


def _column_of(ranges: np.ndarray, batch: BatchLayout) -> np.ndarray:
    """Which batch column each range lands in (by local offset)."""
    starts = np.array([c.offset for c in batch.columns], dtype=np.int64)
    return np.searchsorted(starts, ranges[:, LOCAL], side="right") - 1


def copy_ranges(src: np.ndarray, dst: Any, ranges: np.ndarray) -> int:
    """One slice copy per (remote, local, length) range; returns the bytes copied."""
    for r_off, l_off, length in ranges[:, (REMOTE, LOCAL, LENGTH)].tolist():
        dst[l_off:l_off + length] = src[r_off:r_off + length]
    return int(ranges[:, LENGTH].sum()) if len(ranges) else 0


def is_gpu_device(device: Any) -> bool:
    """Whether ``device`` names a GPU ("cuda", "cuda:1", "gpu", an int device id)."""
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    text = str(device).lower()
    return text.startswith("cuda") or text.startswith("gpu")


def gpu_index(device: Any) -> int:
    if isinstance(device, int):
        return device
    text = str(device)
    return int(text.split(":", 1)[1]) if ":" in text else 0


class ShmPlane:
    """Batches gathered straight from the mapped segment (NumPy, or the GPU kernel into device memory)."""

    kind = "shm"

    def __init__(self, session, layout: TableLayout | None, *, device: Any = None,
                 columns: ColumnChoice | None = None):
        self.session = session
        self.device = device
        self.columns = columns  # read only these columns (None: all)
        self.bytes_moved = 0  # bytes copied out of the segment
        self._gpu = is_gpu_device(device)
        if self._gpu:
            import gear_kernels

            if not gear_kernels.gpu_available():
                raise RuntimeError(f"device {device!r} asked for, but no CUDA GPU with CuPy is usable here")
        self.layout: TableLayout | None = None
        self.mapping: SegmentMapping | None = None
        self._registration = None
        self._pool = BufferPool()
        self._worker: ThreadPoolExecutor | None = None
        self._streams: list[Any] = []  # GPU: batches' gathers take turns on these
        self._launches = 0
        if layout is not None:
            self.set_layout(layout)

    def set_layout(self, layout: TableLayout, region=None) -> None:
        """Map (and, for a GPU, register) the segment of ``layout``, replacing the previous one."""
        mapping = SegmentMapping(layout)
        registration = None
        if self._gpu:
            import gear_kernels

            cp = gear_kernels.backend.require_cupy()
            try:
                with cp.cuda.Device(gpu_index(self.device)):
                    registration = gear_kernels.HostRegistration(mapping.buffer, read_only=True)
            except BaseException:
                mapping.close()
                raise
        self._unmap()
        self.layout, self.mapping, self._registration = layout, mapping, registration

    def fetch(self, selection, window: WindowSpec) -> SampledBatch:
        return self.start(selection, window).wait()

    def start(self, selection, window: WindowSpec) -> Pending:
        """Begin gathering a selection: a GPU kernel on the current stream, or a copy on a worker thread."""
        layout, lengths = narrowed(self.columns, self.layout, selection.lengths)
        n = len(selection)
        windows = resolve_windows(layout, window)
        bounds = window_bounds(lengths, layout, windows)
        keys, probs, sizes, prios, times = selection.infos
        squeeze = tuple(c.squeeze for c in layout.columns)

        def done(columns) -> SampledBatch:
            return SampledBatch(keys, probs, sizes, prios, times, columns, bounds[1].astype(np.int32),
                                layout.structure, squeeze, plane=self.kind)

        if self._gpu:
            columns, event = self._gather_gpu(layout, selection, lengths, windows)
            self.bytes_moved += int(sum(int(bounds[1][:, c].sum()) * col.step_bytes
                                       for c, col in enumerate(layout.columns)))
            return Pending(lambda: (event.synchronize(), done(columns))[1])  # waits for this batch alone
        batch = BatchLayout.build(layout, n, window_steps(windows))
        out = self._pool.get(batch.nbytes)

        def copy() -> SampledBatch:  # plans what it copies by range
            self.bytes_moved += gather_numpy(self.mapping, selection.slots, bounds, None, batch, out, layout)
            return done(column_arrays(out, layout, batch, n))

        if self._worker is None or batch.nbytes < WORKER_MIN_BYTES:
            return Pending(None, copy())
        future = self._worker.submit(copy)  # NumPy copies release the GIL: the next Select overlaps
        return Pending(future.result)

    def cancel(self) -> None:
        """Nothing to end: a gather never waits on the daemon (closing the session ends a Select)."""

    def pipelined(self) -> None:
        """Gather on a worker thread from now on (start() returns before the copy is done)."""
        if self._worker is None and not self._gpu:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="gear-shm-gather")

    def _gather_gpu(self, layout: TableLayout, selection, lengths: np.ndarray,
                    windows) -> tuple[list[Any], Any]:
        import gear_kernels

        cp = gear_kernels.backend.require_cupy()
        with cp.cuda.Device(gpu_index(self.device)):
            if not self._streams:
                self._streams = [cp.cuda.Stream(non_blocking=True) for _ in range(GPU_STREAMS)]
            stream = self._streams[self._launches % GPU_STREAMS]
            self._launches += 1
            queued = cp.cuda.Event(block=False, disable_timing=True)
            queued.record(cp.cuda.get_current_stream())
            stream.wait_event(queued)  # the memory reused below may be a batch the learner's queued work reads
            with stream:  # inputs, output and kernel of this batch in its own stream's order
                result = self._gather_batch(layout, selection, lengths.astype(np.int32), windows)
                event = cp.cuda.Event(block=False, disable_timing=True)
                event.record(stream)  # the bytes are in when this fires
        columns = []
        for col, arr in zip(layout.columns, result.columns, strict=True):
            columns.append(arr.reshape((arr.shape[0], *col.shape)) if col.squeeze else arr)
        return columns, event

    def _gather_batch(self, layout: TableLayout, selection, lengths: np.ndarray, windows) -> Any:
        """The gather kernel's batch of ``selection`` from the registered segment (on the current stream)."""
        import gear_kernels

        return gear_kernels.gather(layout, self._registration, selection.slots, lengths, windows)

    def _unmap(self) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for stream in self._streams:
            stream.synchronize()  # no gather may still read the segment when it is unregistered
        self._streams = []
        self._unmap()
        self._pool.clear()
