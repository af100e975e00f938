"""A sampled batch as every data plane delivers it, and the buffers batches live in.

A batch holds, per column, one ``[batch, steps, *shape]`` array (``[batch, *shape]``
for squeezed columns) padded with zeros past each item's length, the per-item,
per-column valid lengths and the SampleInfo fields as arrays. The arrays are NumPy
on the CPU, or device arrays (CuPy) when the batch was gathered on a GPU; both
export DLPack for PyTorch and JAX without a copy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from gear_client.data_planes.range_planning import BatchLayout
from gear_client.replay_sample import ReplaySample, SampleInfo
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout


@dataclass
class SampledBatch:
    """``batch_size`` items sampled together (see module docstring)."""

    keys: np.ndarray  # uint64 [B]
    probabilities: np.ndarray  # float64 [B]
    table_sizes: np.ndarray  # int64 [B]
    priorities: np.ndarray  # float64 [B]
    times_sampled: np.ndarray  # int32 [B]
    columns: list[Any]  # per column: [B, T, *shape] or [B, *shape] (squeezed)
    lengths: np.ndarray  # int32 [B, C]: valid steps of each item in each column
    structure: pb.Structure
    squeeze: tuple[bool, ...]
    plane: str = ""

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def info(self) -> SampleInfo:
        """SampleInfo whose fields are arrays over the batch (as Reverb's datasets give them)."""
        return SampleInfo(self.keys, self.probabilities, self.table_sizes, self.priorities, self.times_sampled)

    @property
    def data(self) -> Any:
        """The columns arranged as the item structure (dicts, tuples, namedtuples...)."""
        return nest.unflatten(self.structure, self.columns)

    def sample(self) -> ReplaySample:
        return ReplaySample(self.info, self.data)

    def split(self, size: int) -> list[SampledBatch]:
        """Consecutive batches of ``size`` items (the last may be short): views of this one, nothing copied.

        A pipelined Select asks for several batches at once and one gather reads
        them all; the learner gets them one batch at a time.
        """
        n = len(self)
        if n <= size:
            return [self]
        return [SampledBatch(self.keys[i:i + size], self.probabilities[i:i + size], self.table_sizes[i:i + size],
                             self.priorities[i:i + size], self.times_sampled[i:i + size],
                             [c[i:i + size] for c in self.columns], self.lengths[i:i + size], self.structure,
                             self.squeeze, plane=self.plane)
                for i in range(0, n, size)]

    def item_infos(self) -> list[SampleInfo]:
        return [SampleInfo(*row) for row in zip(self.keys.tolist(), self.probabilities.tolist(),
                                                self.table_sizes.tolist(), self.priorities.tolist(),
                                                self.times_sampled.tolist(), strict=True)]

    def item_columns(self, i: int) -> list[Any]:
        """Item i's leaves, each cut to the item's own length (``[*shape]`` for squeezed columns)."""
        lengths = self.lengths[i].tolist()
        return [col[i, ...] if self.squeeze[c] else col[i, :lengths[c]] for c, col in enumerate(self.columns)]

    def items(self) -> list[ReplaySample]:
        """One ReplaySample per item (its own length, data in the item structure)."""
        return [ReplaySample(info, nest.unflatten(self.structure, self.item_columns(i)))
                for i, info in enumerate(self.item_infos())]


def info_arrays(infos) -> tuple[np.ndarray, ...]:
    """SampleInfo protos -> (keys, probabilities, table_sizes, priorities, times_sampled) arrays."""
    n = len(infos)
    keys = np.fromiter((i.key for i in infos), np.uint64, n)
    probabilities = np.fromiter((i.probability for i in infos), np.float64, n)
    table_sizes = np.fromiter((i.table_size for i in infos), np.int64, n)
    priorities = np.fromiter((i.priority for i in infos), np.float64, n)
    times_sampled = np.fromiter((i.times_sampled for i in infos), np.int32, n)
    return keys, probabilities, table_sizes, priorities, times_sampled


def column_arrays(buffer: Any, layout: TableLayout, batch: BatchLayout, n: int, xp=np) -> list[Any]:
    """Per-column views of a batch buffer (uint8, 1-D; NumPy or CuPy) for the first ``n`` items."""
    out = []
    for col, dst in zip(layout.columns, batch.columns, strict=True):
        size = n * dst.item_bytes
        flat = buffer[dst.offset:dst.offset + size].view(col.dtype)
        shape = (n, *col.shape) if col.squeeze else (n, dst.steps, *col.shape)
        out.append(flat.reshape(shape))
    return out


PAGE = 4096


def page_aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer starting on a page boundary (its ``.base`` owns the memory).

    Table slots start on page boundaries too; a destination 16 bytes off (what
    malloc gives large arrays) makes every row copy 3-4x slower on x86-64
    (measured: 2.8 against 10-12 GB/s for 256 KiB rows), so batches are page-aligned.
    """
    owner = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-owner.ctypes.data) % PAGE
    return owner[start:start + nbytes]


class BufferPool:
    """Reuses batch buffers once nothing outside the pool refers to their memory.

    Fresh buffers cost page faults on first touch (about half the copy speed);
    a learner that drops each batch before the next keeps reusing a few buffers.
    Whatever holds the memory (a batch's arrays, a gather still writing it) holds
    a reference to the buffer or to an object of its ``.base`` chain (an owning
    ndarray, the mmap of a registered RDMA buffer). A buffer any of whose chain
    has more references than right after its allocation is in use and is never
    handed out again. Past ``max_buffers`` the oldest is forgotten: ``forget``
    (the RDMA plane deregisters it) is called with it, and its memory is freed
    once the learner drops its batch.
    """

    def __init__(self, allocate=None, max_buffers: int = 8, forget=None):
        self._allocate = allocate or page_aligned_empty
        self._forget = forget
        self._buffers: list[list] = []  # [buffer, reference counts of its .base chain when idle]
        self.max_buffers = max_buffers

    def _references(self, i: int) -> list[int]:
        """Reference counts along entry i's ``.base`` chain (measured the same way every time)."""
        counts = []
        obj = self._buffers[i][0]
        while obj is not None:
            counts.append(sys.getrefcount(obj))
            obj = obj.base if isinstance(obj, np.ndarray) else None
        return counts

    def _idle(self, i: int) -> bool:
        return all(now <= then for now, then in zip(self._references(i), self._buffers[i][1], strict=True))

    def get(self, nbytes: int) -> Any:
        for i in range(len(self._buffers)):
            if self._buffers[i][0].nbytes >= nbytes and self._idle(i):
                entry = self._buffers.pop(i)
                self._buffers.append(entry)
                return entry[0]
        self._buffers.append([self._allocate(nbytes), []])
        self._buffers[-1][1] = self._references(len(self._buffers) - 1)
        buf = self._buffers[-1][0]
        if len(self._buffers) > self.max_buffers:
            forgotten = self._buffers.pop(0)[0]  # freed when the user drops it
            if self._forget is not None:
                self._forget(forgotten)
        return buf

    def clear(self) -> None:
        self._buffers.clear()


class Pending:
    """A batch being gathered: ``wait()`` returns it once its bytes are all in.

    Planes start a gather and return at once where they can (a GPU kernel on a
    stream, a CPU copy on a worker thread), so a pipelining learner selects the
    next batch meanwhile. The lease may be released only after ``wait()``.
    """

    def __init__(self, finish, batch: SampledBatch | None = None):
        self._finish = finish  # callable -> SampledBatch, or None when already done
        self._batch = batch

    def wait(self) -> SampledBatch:
        if self._batch is None:
            self._batch = self._finish()
            self._finish = None
        return self._batch
