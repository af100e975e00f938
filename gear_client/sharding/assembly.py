"""One batch out of the pieces several shards gave: the learner sees a single table's batch.

The pieces (every shard's part, or several chunks of one shard's read-ahead
stream, all in one flat list) are copied once into one output batch in a random
row order (a part must not sit at fixed rows, as i.i.d. picks of one table
would not). Columns of different padded lengths (shards whose slots hold
different maximum lengths) are padded to the longest: only the padding past a
shorter piece's steps is zeroed; valid lengths travel with the batch.

On the CPU each piece is one fancy-index copy per column, into a page-aligned
buffer that a consumer's ``HostAssembly`` reuses once the learner has dropped
every batch in it (the shm plane's BufferPool, as one daemon's batches). On a GPU
(``DeviceAssembly``, one per consumer) every row of every column of every piece
is one task of a single kernel launch on the consumer's own non-blocking
stream: the task table (and the bytes of host pieces, e.g. inline parts) goes up
in one pinned copy, the output is ``empty`` (the kernel writes every byte,
padding included). Nothing runs on the legacy default stream, so the shards'
read-ahead gathers never serialise with it. Ordering is by events, never host
waits: the assembly waits for the work already queued on the caller's current
stream (the output may reuse the memory of a batch the learner just dropped,
as one daemon's gathers do), and the current stream then waits for the
assembly (the batch is ready in the learner's stream order). The pieces stay
referenced until the copy is done, so their memory is not handed to a new
gather while the kernel still reads it.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

import numpy as np

from gear_client.data_planes.batch import BufferPool, SampledBatch
from gear_client.data_planes.shm import gpu_index, is_gpu_device

OUT_ALIGNMENT = 256  # each column's block in the output buffer starts on this boundary
MAX_RETAINED = 8  # assemblies whose inputs are kept until their copy is done; beyond, the oldest is waited for
_TASK_FIELDS = 4  # per task: source address, destination address, bytes copied, row bytes (the rest zeroed)
_BLOCK_THREADS = 256
_BLOCK_BYTES = 16 << 10  # bytes of a row one block writes (256 threads x 16 B x 4)



def assemble(pieces: list[SampledBatch], rng: np.random.Generator, device: Any = None,
             context: DeviceAssembly | HostAssembly | None = None, probabilities: np.ndarray | None = None,
             table_size: int | None = None, order: np.ndarray | None = None) -> SampledBatch:
    """The pieces as one batch (rows shuffled, one copy); a single piece is returned as it is.

    ``device`` names a GPU: the batch is assembled there. ``context``: the
    consumer's DeviceAssembly (GPU; default one per device) or HostAssembly
    (CPU; default fresh arrays). ``probabilities`` (the pieces' rows in order)
    and ``table_size`` replace the pieces' own (a sharded table's global ones). ``order``: where the
    pieces' rows (in order) land, instead of a permutation drawn from ``rng`` (a group rank's rows).
    """
    if not pieces:
        raise ValueError("nothing to assemble")
    if len(pieces) == 1:
        piece = pieces[0]
        if probabilities is not None:
            piece.probabilities = np.asarray(probabilities)
        if table_size is not None:
            piece.table_sizes = np.full(len(piece), table_size, np.int64)
        return piece
    first = pieces[0]
    for p in pieces[1:]:
        if p.structure != first.structure or tuple(p.squeeze) != tuple(first.squeeze) or \
                len(p.columns) != len(first.columns):
            raise ValueError("the shards of this table hold items of different structures; configure every "
                             "daemon's table alike (same signature)")
    shapes = _column_shapes(pieces)
    sizes = [len(p) for p in pieces]
    total = sum(sizes)
    if order is None:
        order = rng.permutation(total)  # piece j's rows land at order[starts[j]:starts[j] + sizes[j]]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    if is_gpu_device(device):
        if not isinstance(context, DeviceAssembly):
            context = _default_context(gpu_index(device))
        columns = context.columns(pieces, order, starts, shapes)
    else:
        buffer = context.buffer(shapes, len(order)) if isinstance(context, HostAssembly) else None
        columns = _columns_numpy(pieces, order, starts, shapes, buffer)

    inverse = np.empty_like(order)
    inverse[order] = np.arange(total, dtype=order.dtype)  # output row r is input row inverse[r]

    def gather(field: str, given: np.ndarray | None = None) -> np.ndarray:
        values = np.concatenate([getattr(p, field) for p in pieces]) if given is None else np.asarray(given)
        return values[inverse]

    sizes_out = gather("table_sizes") if table_size is None else np.full(total, table_size, np.int64)
    planes = {p.plane for p in pieces}
    return SampledBatch(gather("keys"), gather("probabilities", probabilities), sizes_out, gather("priorities"),
                        gather("times_sampled"), columns, gather("lengths"), first.structure, first.squeeze,
                        plane=first.plane if len(planes) == 1 else "+".join(sorted(planes)))


def _column_shapes(pieces: list[SampledBatch]) -> list[tuple[np.dtype, tuple[int, ...]]]:
    """Per column (dtype, shape of one output row): pieces padded to the most steps; mismatches refused."""
    out = []
    for c, squeezed in enumerate(pieces[0].squeeze):
        arrays = [p.columns[c] for p in pieces]
        dtype = arrays[0].dtype  # a numpy dtype for NumPy and CuPy arrays alike
        cut = 1 if squeezed else 2
        tail = arrays[0].shape[cut:]
        for a in arrays[1:]:
            if a.dtype != dtype or a.shape[cut:] != tail:
                raise ValueError(f"column {c}: the shards gave {dtype}{list(tail)} and {a.dtype}"
                                 f"{list(a.shape[cut:])} items; configure every daemon's table alike "
                                 f"(same signature)")
        if squeezed:
            out.append((np.dtype(dtype), tuple(tail)))
        else:
            out.append((np.dtype(dtype), (max(a.shape[1] for a in arrays), *tail)))
    return out


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // OUT_ALIGNMENT) * OUT_ALIGNMENT


def _placement(shapes: list[tuple[np.dtype, tuple[int, ...]]], total: int) -> tuple[list[int], int]:
    """(byte offset of each column's block, bytes) of a batch of ``total`` rows in one buffer."""
    offsets, nbytes = [], 0
    for dtype, row in shapes:
        offsets.append(nbytes)
        nbytes += _aligned(total * math.prod(row) * dtype.itemsize)
    return offsets, nbytes


class HostAssembly:
    """A consumer's CPU assembly: batches in page-aligned buffers reused once the learner dropped them."""

    def __init__(self):
        self._pool = BufferPool()
        self._lock = threading.Lock()

    def buffer(self, shapes: list[tuple[np.dtype, tuple[int, ...]]], total: int) -> np.ndarray:
        """A buffer for a batch of ``total`` rows laid out by ``_placement`` (no batch still refers to it)."""
        with self._lock:
            return self._pool.get(max(_placement(shapes, total)[1], 1))

    def clear(self) -> None:
        with self._lock:
            self._pool.clear()


def _columns_numpy(pieces: list[SampledBatch], order: np.ndarray, starts: np.ndarray,
                   shapes: list[tuple[np.dtype, tuple[int, ...]]], buffer: np.ndarray | None = None
                   ) -> list[np.ndarray]:
    """Host columns (fresh, or blocks of ``buffer`` as ``_placement`` lays them out): per piece one
    fancy-index copy; only the steps past a shorter piece's are zeroed."""
    total = len(order)
    columns = []
    offsets, _ = _placement(shapes, total)
    for c, (dtype, row) in enumerate(shapes):
        if buffer is None:
            out = np.empty((total, *row), dtype)
        else:
            count = total * math.prod(row)
            out = buffer[offsets[c]:offsets[c] + count * dtype.itemsize].view(dtype).reshape((total, *row))
        for p, start in zip(pieces, starts.tolist(), strict=True):
            n = len(p)
            if n == 0:
                continue
            index = order[start:start + n]
            a = np.asarray(p.columns[c])
            if p.squeeze[c] or a.shape[1] == row[0]:
                out[index] = a
            else:
                out[index, :a.shape[1]] = a
                out[index, a.shape[1]:] = 0
        columns.append(out)
    return columns


def plan_rows(sources: Any, sizes: list[int], order: np.ndarray, starts: np.ndarray,
              bases: list[int], row_bytes: list[int], out: np.ndarray | None = None) -> np.ndarray:
    """The assembly kernel's tasks, ``int64 [columns, rows, 4]``: one per output row of each column.

    ``sources[c][j]``: (address of piece j's row 0 in column c, its bytes per
    row), a nested list or ``int64 [columns, pieces, 2]``; piece j's rows land
    at ``order[starts[j]:starts[j] + sizes[j]]`` (``starts``: the running sum of
    ``sizes``) of a column whose block starts at ``bases[c]`` with
    ``row_bytes[c]`` per row. A task is (source, destination, bytes copied, row
    bytes): the kernel zeroes the row past the bytes copied (a shorter piece's
    padding). A few array operations per batch, none per piece or row.
    """
    total = len(order)
    num_columns, num_pieces = len(bases), len(sizes)
    tasks = np.empty((num_columns, total, _TASK_FIELDS), np.int64) if out is None else out
    if total == 0 or num_columns == 0:
        return tasks
    src = np.asarray(sources, dtype=np.int64).reshape(num_columns, num_pieces, 2)
    counts = np.asarray(sizes, dtype=np.int64)
    row = np.asarray(row_bytes, dtype=np.int64)
    too_long = (src[:, :, 1] > row[:, None]) & (counts > 0)[None, :]
    if too_long.any():
        c, j = (int(x) for x in np.argwhere(too_long)[0])
        raise ValueError(f"column {c}: a piece's rows ({int(src[c, j, 1])} bytes) exceed the batch's ({int(row[c])})")
    piece = np.repeat(np.arange(num_pieces), counts)  # the piece of each input row
    local = np.arange(total, dtype=np.int64) - np.asarray(starts, dtype=np.int64)[piece]  # its row in the piece
    copy = src[:, piece, 1]
    np.multiply(local, copy, out=tasks[:, :, 0])
    tasks[:, :, 0] += src[:, piece, 0]
    np.multiply(np.asarray(order, dtype=np.int64)[None, :], row[:, None], out=tasks[:, :, 1])
    tasks[:, :, 1] += np.asarray(bases, dtype=np.int64)[:, None]
    tasks[:, :, 2] = copy
    tasks[:, :, 3] = row[:, None]
    return tasks


def _kernel(device: int) -> Any:
    """gear_kernels/assemble.cu's kernel, loaded for ``device``."""
    import cupy as cp

    from gear_kernels.backend import kernel

    with cp.cuda.Device(device):
        return kernel("assemble", "gear_assemble_rows")


class DeviceAssembly:
    """A consumer's GPU assembly: its own non-blocking stream, and inputs kept until their copy is done.

    Thread safe (one assembly at a time); see the module docstring for the ordering.
    """

    def __init__(self, device: Any):
        self.device = gpu_index(device)
        self._stream = None
        self._lock = threading.Lock()
        self._retained: deque[tuple[Any, tuple]] = deque()  # (done event, what the copy reads)

    def columns(self, pieces: list[SampledBatch], order: np.ndarray, starts: np.ndarray,
                shapes: list[tuple[np.dtype, tuple[int, ...]]]) -> list[Any]:
        """Device columns of the assembled batch (queued on this assembly's stream, ordered as above)."""
        import cupy as cp

        if len(order) == 0:
            with cp.cuda.Device(self.device):
                return [cp.empty((0, *row), dtype) for dtype, row in shapes]
        with self._lock, cp.cuda.Device(self.device):
            if self._stream is None:
                self._stream = cp.cuda.Stream(non_blocking=True)
            self._reap()
            return self._launch(cp, pieces, order, starts, shapes)

    def _launch(self, cp: Any, pieces: list[SampledBatch], order: np.ndarray, starts: np.ndarray,
                shapes: list[tuple[np.dtype, tuple[int, ...]]]) -> list[Any]:
        total = len(order)
        stream = self._stream
        current = cp.cuda.get_current_stream()
        after_user = cp.cuda.Event(block=False, disable_timing=True)
        after_user.record(current)  # what the learner queued so far (it may still read memory reused below)
        stream.wait_event(after_user)  # before this stream writes anything
        offsets, nbytes = _placement(shapes, total)  # one output buffer, a block per column
        row_bytes = [math.prod(row) * dtype.itemsize for dtype, row in shapes]
        num_columns = len(shapes)
        num_tasks = total * num_columns
        upload_bytes = _aligned(num_tasks * _TASK_FIELDS * 8)
        # Sources: device pieces where they are; host pieces (inline parts) in the pinned copy after the tasks.
        sources = [[[0, 0] for _ in pieces] for _ in range(num_columns)]  # [column][piece]: address, row bytes
        held = []  # contiguous copies of strided device pieces (read by the kernel)
        host = []  # (column, piece, array, upload offset)
        with stream:
            for j, p in enumerate(pieces):
                n = len(p)
                if n == 0:
                    continue
                for c, a in enumerate(p.columns):
                    if isinstance(a, cp.ndarray):
                        if not a.flags.c_contiguous:
                            a = cp.ascontiguousarray(a)
                            held.append(a)
                        sources[c][j] = [a.data.ptr, a.nbytes // n]
                    else:
                        a = np.ascontiguousarray(a)
                        host.append((c, j, a, upload_bytes))
                        sources[c][j] = [0, a.nbytes // n]
                        upload_bytes += _aligned(a.nbytes)
            out = cp.empty(max(nbytes, 1), dtype=cp.uint8)
            inputs = cp.empty(upload_bytes, dtype=cp.uint8)
        pinned_mem = cp.cuda.alloc_pinned_memory(upload_bytes)
        pinned = np.frombuffer(pinned_mem, dtype=np.uint8, count=upload_bytes)
        for c, j, a, at in host:
            pinned[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
            sources[c][j][0] = inputs.data.ptr + at
        tasks = pinned[:num_tasks * _TASK_FIELDS * 8].view(np.int64).reshape(num_columns, total, _TASK_FIELDS)
        plan_rows(sources, [len(p) for p in pieces], order, starts,
                  [out.data.ptr + offset for offset in offsets], row_bytes, tasks)
        cp.cuda.runtime.memcpyAsync(inputs.data.ptr, pinned.ctypes.data, upload_bytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        max_row = max(row_bytes, default=0)
        blocks_per_task = max(1, -(-max_row // _BLOCK_BYTES))
        if num_tasks and max_row:
            with stream:
                _kernel(self.device)((num_tasks * blocks_per_task,), (_BLOCK_THREADS,),
                                     (inputs, np.int64(num_tasks), np.int64(blocks_per_task),
                                      np.int64(_BLOCK_BYTES)))
        done = cp.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        current.wait_event(done)  # the learner's later work sees the whole batch
        self._retained.append((done, (pieces, held, pinned_mem, inputs)))
        while len(self._retained) > MAX_RETAINED:
            self._retained.popleft()[0].synchronize()
        return [out[offset:offset + total * nbytes_row].view(dtype).reshape((total, *row))
                for offset, nbytes_row, (dtype, row) in zip(offsets, row_bytes, shapes, strict=True)]

    def _reap(self) -> None:
        """Forget the inputs of assemblies whose copy is done."""
        while self._retained and self._retained[0][0].done:
            self._retained.popleft()

    def synchronize(self) -> None:
        """Wait for every assembly queued (then nothing is retained)."""
        with self._lock:
            while self._retained:
                self._retained.popleft()[0].synchronize()


_contexts: dict[int, DeviceAssembly] = {}
_contexts_lock = threading.Lock()


def _default_context(device: int) -> DeviceAssembly:
    with _contexts_lock:
        context = _contexts.get(device)
        if context is None:
            context = _contexts[device] = DeviceAssembly(device)
        return context


def rows(batch: SampledBatch, start: int, end: int) -> SampledBatch:
    """Rows ``start:end`` of a batch, as views (a read-ahead group cut into batches)."""
    if start == 0 and end == len(batch):
        return batch
    cut = slice(start, end)
    return SampledBatch(batch.keys[cut], batch.probabilities[cut], batch.table_sizes[cut], batch.priorities[cut],
                        batch.times_sampled[cut], [c[cut] for c in batch.columns], batch.lengths[cut],
                        batch.structure, batch.squeeze, plane=batch.plane)
