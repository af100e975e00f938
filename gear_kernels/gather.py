"""Collection: gather selected items' windows into one contiguous batch, per column [B, window, *shape].

GPU path (gather.cu): the table segment is host memory registered with the
device (hostmem.HostRegistration); one launch reads every item's window for a
group of columns straight over PCIe into one device buffer, writes the padding
itself and returns the valid lengths. The batch reaches PyTorch or JAX through
DLPack without a copy (to_torch / to_jax). NumPy twin (gather_numpy): the same
bytes from a host buffer, for machines without a GPU and as the reference.

A window per column says which steps of each item to take:
``Window(length, start, pad)``. Item steps [s0, s0 + length) are taken, where
s0 = start for start >= 0 and s0 = item_length + start for start < 0 (so
start=-length is "the last `length` steps"); steps outside the item are
dropped. The n_valid steps that remain are packed at the start of the row
(pad="tail") or at its end (pad="head"), and the rest of the row is zeros.
``start`` may also be one value per item (an int array of length B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gear_contract.layout import ColumnLayout, TableLayout

from . import twins
from .backend import is_device_array, kernel, require_cupy, staging
from .hostmem import HostRegistration

OUT_ALIGNMENT = 256  # each column's block in the output buffer starts on this boundary
_UNITS_PER_BLOCK = 1024  # gather.cu: GATHER_THREADS * UNITS_PER_THREAD

# The kernel's GatherColumn struct (gather.cu), 64 bytes.
GATHER_COLUMN_DTYPE = np.dtype([
    ("src_offset", np.uint64), ("slot_stride", np.uint64), ("out_offset", np.uint64), ("step_bytes", np.int64),
    ("window", np.int32), ("max_length", np.int32), ("start", np.int32), ("pad_head", np.int32),
    ("length_column", np.int32), ("start_row", np.int32), ("reserved0", np.int32), ("reserved1", np.int32),
])
assert GATHER_COLUMN_DTYPE.itemsize == 64


@dataclass(frozen=True)
class Window:
    """Which steps of each item a column's rows hold (see the module docstring)."""

    length: int | None = None  # steps per row; None: the column's max_length
    start: int | Any = 0  # >= 0 from the item's first step, < 0 from its end; or one per item
    pad: str = "tail"  # "tail": valid steps first, zeros after; "head": zeros first

    def __post_init__(self) -> None:
        if self.pad not in ("head", "tail"):
            raise ValueError(f"Window.pad must be 'head' or 'tail', got {self.pad!r}")
        if self.length is not None and self.length < 1:
            raise ValueError(f"Window.length must be >= 1, got {self.length}")


@dataclass
class Batch:
    """A gathered batch: per selected column a [B, window, *shape] array, and valid lengths [B, C]."""

    columns: list[Any]
    lengths: Any  # int32 [B, len(columns)]; -1 where a slot was out of range
    buffer: Any  # the one contiguous buffer every column lives in
    column_indices: tuple[int, ...]


def _windows(layout: TableLayout, columns: Sequence[int], windows: Window | Sequence[Window] | None
             ) -> list[Window]:
    if windows is None or isinstance(windows, Window):
        windows = [windows or Window()] * len(columns)
    windows = list(windows)
    if len(windows) != len(columns):
        raise ValueError(f"{len(windows)} windows for {len(columns)} columns")
    out = []
    for c, w in zip(columns, windows, strict=True):
        col = layout.columns[c]
        out.append(Window(col.max_length if w.length is None else w.length, w.start, w.pad))
    return out


def _column_indices(layout: TableLayout, columns: Sequence[int] | None) -> tuple[int, ...]:
    if columns is None:
        return tuple(range(len(layout.columns)))
    columns = tuple(int(c) for c in columns)
    for c in columns:
        if not 0 <= c < len(layout.columns):
            raise ValueError(f"column {c} out of range: the layout has {len(layout.columns)} columns")
    return columns


def output_plan(layout: TableLayout, batch: int, columns: Sequence[int] | None = None,
                windows: Window | Sequence[Window] | None = None) -> tuple[list[int], int]:
    """(byte offset of each column's block, total bytes) of a batch's output buffer."""
    cols = _column_indices(layout, columns)
    offsets, total = [], 0
    for c, w in zip(cols, _windows(layout, cols, windows), strict=True):
        offsets.append(total)
        nbytes = batch * w.length * layout.columns[c].step_bytes
        total += -(-nbytes // OUT_ALIGNMENT) * OUT_ALIGNMENT
    return offsets, total


def _check_inputs(layout: TableLayout, slots: np.ndarray, lengths: np.ndarray) -> None:
    if slots.ndim != 1:
        raise ValueError(f"slots must be 1-D, got shape {slots.shape}")
    if lengths.shape != (slots.shape[0], len(layout.columns)):
        raise ValueError(f"lengths must have shape (batch, columns) = ({slots.shape[0]}, {len(layout.columns)}), "
                         f"got {lengths.shape}")


def _starts(windows: list[Window], batch: int) -> tuple[list[int], np.ndarray | None]:
    """Per column: the row of the per-item starts array, or -1; and that array ([rows, B] int64)."""
    rows, per_item = [], []
    for w in windows:
        if np.ndim(w.start) == 0:
            rows.append(-1)
            continue
        s = np.asarray(w.start if not is_device_array(w.start) else w.start.get(), dtype=np.int64)
        if s.shape != (batch,):
            raise ValueError(f"per-item window starts need shape ({batch},), got {s.shape}")
        rows.append(len(per_item))
        per_item.append(s)
    return rows, (np.stack(per_item) if per_item else None)


def _view(buffer: Any, offset: int, col: ColumnLayout, batch: int, window: int) -> Any:
    count = batch * window * int(np.prod(col.shape, dtype=np.int64))
    flat = buffer[offset:offset + count * col.dtype.itemsize].view(col.dtype)
    return flat.reshape((batch, window, *col.shape))


def gather(layout: TableLayout, source: HostRegistration | Any, slots: Any, lengths: Any,
           windows: Window | Sequence[Window] | None = None, *, columns: Sequence[int] | None = None,
           out: Any = None) -> Batch:
    """Gather items' windows: GPU when ``source`` is a HostRegistration, else the NumPy twin.

    ``slots`` (int64 [B]) and ``lengths`` (int32 [B, all columns]) are what a
    selection returned (lengths: each item's steps per column). ``columns``
    picks a column group (default: all), ``windows`` one Window for all or one
    per column. ``out``: an optional uint8 buffer of at least output_plan()'s
    bytes to fill instead of allocating (on the GPU a CuPy array). Slots outside
    the table raise ValueError on host inputs; given as a device array they
    yield rows of zeros and length -1.
    """
    if not isinstance(source, HostRegistration):
        return gather_numpy(layout, source, slots, lengths, windows, columns=columns, out=out)
    plan = GatherPlan(layout, source, slots, lengths, windows, columns=columns)
    return plan.launch(out)


class GatherPlan:
    """One batch's gather, prepared: descriptors and inputs on the device, ready to launch.

    ``gather()`` is prepare + launch; benchmarks time launch() alone.
    """

    def __init__(self, layout: TableLayout, source: HostRegistration, slots: Any, lengths: Any,
                 windows: Window | Sequence[Window] | None = None, *, columns: Sequence[int] | None = None):
        cp = require_cupy()
        self._cp = cp
        cols = _column_indices(layout, columns)
        wins = _windows(layout, cols, windows)
        if layout.segment_size > source.size:
            raise ValueError(f"the layout needs {layout.segment_size} bytes but the registration holds {source.size}")
        batch = int(slots.shape[0])
        offsets, total = output_plan(layout, batch, cols, wins)
        start_rows, starts = _starts(wins, batch)
        desc = np.zeros(len(cols), dtype=GATHER_COLUMN_DTYPE)
        for i, (c, w) in enumerate(zip(cols, wins, strict=True)):
            col = layout.columns[c]
            start = int(w.start) if start_rows[i] < 0 else 0
            if not -(2**31) <= start < 2**31:
                raise ValueError(f"window start {w.start} out of range")
            desc[i] = (col.offset, col.slot_stride, offsets[i], col.step_bytes, w.length, col.max_length,
                       start, int(w.pad == "head"), c, start_rows[i], 0, 0)
        if is_device_array(slots):
            if slots.dtype != cp.int64 or lengths.dtype != cp.int32 or not lengths.flags.c_contiguous:
                raise ValueError("device slots must be int64 and device lengths contiguous int32")
            if lengths.shape != (batch, len(layout.columns)):
                raise ValueError(f"lengths must have shape ({batch}, {len(layout.columns)}), got {lengths.shape}")
            dev = staging().upload([desc.view(np.uint8)] + ([starts] if starts is not None else []))
            self._desc, self._slots, self._lengths = dev[0], slots, lengths
            self._starts = dev[1] if starts is not None else slots
        else:
            slots_h = np.ascontiguousarray(slots, dtype=np.int64)
            lengths_h = np.ascontiguousarray(lengths, dtype=np.int32)
            _check_inputs(layout, slots_h, lengths_h)
            if batch and (slots_h.min() < 0 or slots_h.max() >= layout.capacity):
                raise ValueError(f"slots must lie in [0, {layout.capacity})")
            dev = staging().upload([desc.view(np.uint8), slots_h, lengths_h] + ([starts] if starts is not None else []))
            self._desc, self._slots, self._lengths = dev[0], dev[1], dev[2]
            self._starts = dev[3] if starts is not None else dev[1]
        self.layout, self.source, self.batch, self.columns, self.windows = layout, source, batch, cols, wins
        self.offsets, self.total_bytes = offsets, total
        max_row = max((w.length * layout.columns[c].step_bytes for c, w in zip(cols, wins, strict=True)), default=0)
        self._chunks = max(1, -(-(max_row // 16 + 2) // _UNITS_PER_BLOCK))
        if batch * self._chunks >= 2**31:
            raise ValueError("batch too large for one launch")

    def launch(self, out: Any = None) -> Batch:
        """Run the kernel on the current stream (asynchronous); the Batch's arrays are ready in stream order."""
        cp = self._cp
        if out is None:
            buffer = cp.empty(max(self.total_bytes, 1), dtype=cp.uint8)
        else:
            if not isinstance(out, cp.ndarray) or out.dtype != cp.uint8 or out.ndim != 1 or out.size < self.total_bytes:
                raise ValueError(f"out must be a 1-D CuPy uint8 array of at least {self.total_bytes} bytes")
            if out.data.ptr % OUT_ALIGNMENT:
                raise ValueError(f"out must start on a {OUT_ALIGNMENT}-byte boundary")
            buffer = out
        ncols = len(self.columns)
        out_lengths = cp.empty((self.batch, ncols), dtype=cp.int32)
        if self.batch and ncols:
            kernel("gather", "gear_gather")(
                (self.batch * self._chunks, ncols), (256,),
                (np.uint64(self.source.device_ptr), np.uint64(self.layout.capacity), self._desc, self._slots,
                 self._lengths, np.int32(len(self.layout.columns)), self._starts, np.int64(self.batch),
                 np.int64(self._chunks), buffer, out_lengths))
        views = [_view(buffer, self.offsets[i], self.layout.columns[c], self.batch, self.windows[i].length)
                 for i, c in enumerate(self.columns)]
        return Batch(views, out_lengths, buffer, self.columns)


def gather_numpy(layout: TableLayout, segment: Any, slots: Any, lengths: Any,
                 windows: Window | Sequence[Window] | None = None, *, columns: Sequence[int] | None = None,
                 out: np.ndarray | None = None) -> Batch:
    """The gather kernel's twin: the same bytes from a host buffer (an mmap of the segment, bytes, an array)."""
    cols = _column_indices(layout, columns)
    wins = _windows(layout, cols, windows)
    seg = np.frombuffer(segment, dtype=np.uint8)
    if layout.segment_size > seg.nbytes:
        raise ValueError(f"the layout needs {layout.segment_size} bytes but the segment holds {seg.nbytes}")
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    _check_inputs(layout, slots, lengths)
    batch = slots.shape[0]
    if batch and (slots.min() < 0 or slots.max() >= layout.capacity):
        raise ValueError(f"slots must lie in [0, {layout.capacity})")
    offsets, total = output_plan(layout, batch, cols, wins)
    if out is None:
        buffer = np.empty(max(total, 1), dtype=np.uint8)
    else:
        if out.dtype != np.uint8 or out.ndim != 1 or out.size < total:
            raise ValueError(f"out must be a 1-D uint8 array of at least {total} bytes")
        buffer = out
    out_lengths = np.empty((batch, len(cols)), dtype=np.int32)
    views = []
    for i, (c, w) in enumerate(zip(cols, wins, strict=True)):
        col = layout.columns[c]
        step = col.step_bytes
        start = np.broadcast_to(np.asarray(w.start, dtype=np.int64), (batch,))
        src_first, n_valid, dst_first = twins.window_bounds(lengths[:, c], start, w.length, col.max_length,
                                                            w.pad == "head")
        rows = buffer[offsets[i]:offsets[i] + batch * w.length * step].reshape(batch, w.length * step)
        rows[:] = 0
        for b in range(batch):
            nv = int(n_valid[b]) * step
            if nv:
                src = col.offset + int(slots[b]) * col.slot_stride + int(src_first[b]) * step
                dst = int(dst_first[b]) * step
                rows[b, dst:dst + nv] = seg[src:src + nv]
        out_lengths[:, i] = n_valid
        views.append(_view(buffer, offsets[i], col, batch, w.length))
    return Batch(views, out_lengths, buffer, cols)


def to_torch(array: Any) -> Any:
    """A torch.Tensor over the same device memory (DLPack, no copy)."""
    import torch

    return torch.from_dlpack(array)


def to_jax(array: Any) -> Any:
    """A jax.Array over the same device memory (DLPack, no copy).

    64-bit dtypes need ``jax_enable_x64``: without it JAX would silently copy and
    narrow them, so that is refused here (ValueError).
    """
    import jax
    import jax.dlpack

    if np.dtype(array.dtype).itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(f"a {np.dtype(array.dtype).name} batch needs jax_enable_x64 (JAX would copy and narrow it)")
    return jax.dlpack.from_dlpack(array)
