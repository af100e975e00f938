"""TrajectoryWriter: Reverb's column-wise writer, streamed over ``InsertStream``.

Data is appended column by column (one column per leaf path of the appended
nests). Each column keeps its recent rows in a contiguous numpy buffer (two
that take turns when the live rows are moved to the front), so any run of
rows an item needs is a single slice. An item references steps; the steps no
earlier item sent are packed, per column, into one ``ChunkData`` (a raw
buffer whose leading dimension is the steps), and the item names
``ColumnSlice``s of chunks. Every step crosses the wire at most once; a chunk
is released (``release_chunk_keys``) once none of its rows can be referenced
again (they left the keep-alive window, or the buffers were cleared).

The writer owns one ``InsertStream`` call: requests are encoded by hand
around the rows' buffers, batched while gRPC's own thread is busy sending
the previous message, and queued to that thread; a reader thread counts the
acknowledged keys. At most ``max_in_flight_items`` items are unacknowledged:
``create_item`` and ``flush`` block beyond that (back-pressure from the
table's rate limiter). A failed stream surfaces on the next ``create_item``/
``flush``/``end_episode`` as Reverb's exception type; the writer then opens a
fresh stream and resends whatever data later items need.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import os
import queue
import random
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from gear_client.errors import DeadlineExceededError, ReverbError, ServiceError, from_rpc_error
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract.allocator import tune_allocator
from gear_contract.specs import shape_compatible, signature_specs
from gear_contract.wire import encode_varint

__all__ = ["TrajectoryWriter", "TrajectoryColumn", "DataReference"]

DEFAULT_MAX_IN_FLIGHT_ITEMS = 128
DEFAULT_MAX_IN_FLIGHT_BYTES = 256 << 20
# A chunk is cut at this many bytes (whole rows) so requests stay well under
# gRPC's default 4 MiB message limit; requests group chunks up to the same size.
MAX_CHUNK_BYTES = 2 << 20
MAX_REQUEST_BYTES = 3 << 20
# Under load, items are batched into requests of about this size.
BATCH_BYTES = 2 << 20
# Spare rows kept beyond the keep-alive window so the buffer is compacted rarely.
_SPARE_BUFFER_BYTES = 1 << 20
_MAX_SPARE_ROWS = 4096
_CLOSE_TIMEOUT_S = 2.0

# A chunk to send: its encoded ``InsertStreamRequest.chunks`` field up to the raw
# data, and the data itself (a view of the column buffer until the batch is joined).
_Chunk = tuple[bytes, memoryview]

_DOUBLE = struct.Struct("<d")

_PY_SCALAR_DTYPES = {float: np.dtype(np.float64), int: np.dtype(np.int64), bool: np.dtype(np.bool_)}


def _format_path(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) if path else "<root>"


# ----------------------------------------------------------------- columns ----

class _Column:
    """One leaf path's recent rows, their history per step, and the chunks that carry them.

    Rows are numbered per column from 0 (``nrows`` is the next). Row ``r``
    lives at ``buf[r - buf_first_row]``; ``hist`` holds the row of each of the
    last ``keep`` steps (None where the step had no data for this column).
    """

    __slots__ = (
        "path", "index", "keep", "max_chunk_length", "dtype", "shape", "fast_types", "buf", "cap",
        "buf_first_row", "nrows", "row_step", "hist", "chunks", "chunk_firsts", "episode_marks", "row_bytes",
        "dtype_wire", "spare_buf",
        "__weakref__",
    )

    def __init__(self, path: tuple, index: int, keep: int, padding: int, episode_id: int):
        self.path = path
        self.index = index
        self.keep = keep
        self.max_chunk_length: int | None = None
        self.dtype: np.dtype | None = None
        self.dtype_wire = b""  # dtype.str, encoded for the wire
        self.shape: tuple | None = None
        self.fast_types: tuple = ()
        self.buf: np.ndarray | None = None
        self.spare_buf: np.ndarray | None = None  # the buffer compaction moves rows into next
        self.cap = 0
        self.buf_first_row = 0
        self.nrows = 0
        self.row_step: list[int] = []
        self.hist: deque = deque([None] * min(padding, keep), maxlen=keep)
        # Live chunks, sorted: [first_row, end_row, chunk_key]; chunk_firsts mirrors first_row.
        self.chunks: list[list[int]] = []
        self.chunk_firsts: list[int] = []
        # (first row, episode id) of each episode whose rows may still be alive.
        self.episode_marks: list[tuple[int, int]] = [(0, episode_id)]
        self.row_bytes = 0

    @property
    def name(self) -> str:
        return _format_path(self.path)

    # -- data ------------------------------------------------------------
    def convert(self, value: Any) -> Any:
        """Check (and convert) one step's value; fixes dtype and shape on first use."""
        if type(value) is np.ndarray:
            arr = value
        else:
            try:
                arr = np.asarray(value)
            except Exception as e:  # noqa: BLE001 - report which column failed
                raise ValueError(f"column {self.name}: cannot convert {type(value).__name__} to an array: {e}") from e
        if arr.dtype.hasobject:
            raise ValueError(f"column {self.name}: values of type {type(value).__name__} cannot be stored "
                             f"(object dtype); use numeric or fixed-width arrays")
        if self.dtype is None:
            self._init_storage(arr)
        elif arr.dtype != self.dtype or arr.shape != self.shape:
            raise ValueError(
                f"column {self.name}: expected dtype {self.dtype} and shape {self.shape}, got dtype "
                f"{arr.dtype} and shape {arr.shape}"
            )
        return arr

    def _init_storage(self, arr: np.ndarray) -> None:
        self.dtype = arr.dtype
        self.dtype_wire = arr.dtype.str.encode()
        self.shape = tuple(arr.shape)
        self.row_bytes = max(1, arr.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64)))
        fast = []
        if self.shape == ():
            fast.append(arr.dtype.type)
            for py, dt in _PY_SCALAR_DTYPES.items():
                if dt == arr.dtype:
                    fast.append(py)
        self.fast_types = tuple(fast)
        self._allocate()

    def _allocate(self) -> None:
        spare = max(self.keep, min(_MAX_SPARE_ROWS, max(16, _SPARE_BUFFER_BYTES // self.row_bytes)))
        cap = self.keep + spare
        buf = np.empty((cap,) + self.shape, dtype=self.dtype)
        steps = [0] * cap
        if self.buf is not None:
            live = self.min_live_row()
            n = self.nrows - live
            if n:
                src = live - self.buf_first_row
                buf[:n] = self.buf[src:src + n]
                steps[:n] = self.row_step[src:src + n]
            self.buf_first_row = live
        else:
            self.buf_first_row = self.nrows
        self.buf, self.cap, self.row_step = buf, cap, steps
        self.spare_buf = None

    def compact(self, before_move: Any = None) -> int:
        """Move the live rows to the front of the other buffer; returns the position of the next row.

        Two buffers take turns, so rows of the current one stay where they are
        (chunks waiting in a batch are views of them). ``before_move(column,
        target)`` is called before ``target`` is overwritten.
        """
        live = self.min_live_row()
        src = live - self.buf_first_row
        n = self.nrows - live
        if n + 1 > self.cap:  # the keep-alive window grew (configure)
            self._allocate()
            return self.nrows - self.buf_first_row
        target = self.spare_buf
        if target is None:
            target = np.empty_like(self.buf)
        elif before_move is not None:
            before_move(self, target)
        if n:
            target[:n] = self.buf[src:src + n]
            self.row_step[:n] = self.row_step[src:src + n]
        self.buf, self.spare_buf = target, self.buf
        self.buf_first_row = live
        return n

    def min_live_row(self) -> int:
        """The oldest row items may still reference (rows below it expired)."""
        for row in self.hist:
            if row is not None:
                return row
        return self.nrows

    def rows_array(self, first: int, end: int) -> np.ndarray:
        return self.buf[first - self.buf_first_row:end - self.buf_first_row]

    def episode_of(self, row: int) -> tuple[int, int]:
        """(episode id, first row of the next episode or a large number) for a row."""
        marks = self.episode_marks
        i = bisect.bisect_right(marks, (row, 1 << 64)) - 1
        nxt = marks[i + 1][0] if i + 1 < len(marks) else 1 << 62
        return marks[max(i, 0)][1], nxt

    # -- history ---------------------------------------------------------
    def set_keep(self, keep: int) -> None:
        if keep == self.keep:
            return
        self.hist = deque(self.hist, maxlen=keep)
        self.keep = keep
        if self.buf is not None and self.cap < keep + 1:
            self._allocate()

    def clear(self, episode_id: int) -> None:
        """Forget every row (end_episode with clear_buffers); chunks are released by the writer."""
        self.hist.clear()
        self.episode_marks = [(self.nrows, episode_id)]

    def drop_dead_marks(self) -> None:
        live = self.min_live_row()
        marks = self.episode_marks
        while len(marks) > 1 and marks[1][0] <= live:
            marks.pop(0)


# ------------------------------------------------------------- references ----

class DataReference:
    """A reference to one step of one column (Reverb's ``WeakCellRef``)."""

    __slots__ = ("_column", "_row")

    def __init__(self, column: _Column, row: int):
        self._column = column
        self._row = row

    @property
    def expired(self) -> bool:
        return self._row < self._column.min_live_row()

    @property
    def shape(self) -> tuple:
        return self._column.shape

    @property
    def dtype(self) -> np.dtype:
        return self._column.dtype

    def numpy(self) -> np.ndarray:
        if self.expired:
            raise RuntimeError(f"data reference to column {self._column.name} has expired")
        return self._column.rows_array(self._row, self._row + 1)[0].copy()

    def __repr__(self) -> str:
        return f"DataReference(column={self._column.name}, row={self._row}, expired={self.expired})"


class TrajectoryColumn:
    """Steps of one or more columns (same dtype and shape) forming one leaf of an item."""

    __slots__ = ("_segments", "_len", "is_squeezed", "_path")

    def __init__(self, data_references: Sequence[DataReference], *, squeeze: bool = False,
                 path: tuple | None = None):
        refs = list(data_references)
        if squeeze and len(refs) != 1:
            raise ValueError(f"Columns must contain exactly one data reference when squeeze set, got {len(refs)}")
        if any(ref is None for ref in refs):
            raise ValueError(f"TrajectoryColumns cannot contain any None data references: TrajectoryColumn at "
                             f"path {path} got {refs}.")
        for ref in refs:
            if not isinstance(ref, DataReference):
                raise TypeError(f"TrajectoryColumn takes data references from a writer's history, got "
                                f"{type(ref).__name__}")
        segments: list[tuple[_Column, list[int]]] = []
        for ref in refs:
            if segments and segments[-1][0] is ref._column:
                segments[-1][1].append(ref._row)
            else:
                segments.append((ref._column, [ref._row]))
        self._segments = [(c, _as_rows(r)) for c, r in segments]
        self._len = len(refs)
        self.is_squeezed = bool(squeeze)
        self._path = path

    @classmethod
    def _of_rows(cls, column: _Column, rows: Sequence[int], squeeze: bool, path: tuple | None) -> TrajectoryColumn:
        self = cls.__new__(cls)
        self._segments = [(column, rows)] if len(rows) else []
        self._len = len(rows)
        self.is_squeezed = squeeze
        self._path = path
        return self

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[DataReference]:
        for column, rows in self._segments:
            for r in rows:
                yield DataReference(column, r)

    def __getitem__(self, val: Any) -> TrajectoryColumn:
        if len(self._segments) == 1:
            column, rows = self._segments[0]
            if isinstance(val, (int, np.integer)):
                return TrajectoryColumn._of_rows(column, [rows[val]], True, None)
            if isinstance(val, slice):
                return TrajectoryColumn._of_rows(column, rows[val], False, None)
            if isinstance(val, list):
                return TrajectoryColumn._of_rows(column, _as_rows([rows[i] for i in val]), False, None)
        refs = list(self)
        if isinstance(val, (int, np.integer)):
            return TrajectoryColumn([refs[val]], squeeze=True)
        if isinstance(val, slice):
            return TrajectoryColumn(refs[val])
        if isinstance(val, list):
            return TrajectoryColumn([refs[i] for i in val])
        raise TypeError(f"TrajectoryColumn indices must be integers or slices, not {type(val)}")

    @property
    def shape(self) -> tuple:
        step_shape = self._segments[0][0].shape if self._segments else ()
        return tuple(step_shape) if self.is_squeezed else (self._len, *step_shape)

    @property
    def dtype(self) -> np.dtype | None:
        return self._segments[0][0].dtype if self._segments else None

    def _check_alive(self) -> bool:
        for column, rows in self._segments:
            if min(rows) < column.min_live_row():
                return False
        return True

    def numpy(self) -> np.ndarray:
        """The referenced steps stacked (one step without time dimension when squeezed)."""
        if not self._check_alive():
            raise RuntimeError("Cannot convert TrajectoryColumn with expired data references to numpy array.")
        parts = []
        for column, rows in self._segments:
            if isinstance(rows, range) and rows.step == 1:
                parts.append(column.rows_array(rows.start, rows.stop))
            else:
                base = column.buf_first_row
                parts.append(column.buf[[r - base for r in rows]])
        if self.is_squeezed:
            return parts[0][0].copy()
        if not parts:
            return np.zeros((0,), np.float32)
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def __repr__(self) -> str:
        return f"TrajectoryColumn(path={self._path}, len={self._len}, squeezed={self.is_squeezed})"


def _as_rows(rows: list[int]) -> Sequence[int]:
    """A range when the rows are consecutive (the common case), else the list."""
    n = len(rows)
    if n and rows[-1] - rows[0] == n - 1 and all(b - a == 1 for a, b in itertools.pairwise(rows)):
        return range(rows[0], rows[-1] + 1)
    return rows


class _StepCount:
    """Steps in the history since the buffers were last cleared (shared with the history views)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class _ColumnHistory:
    """``writer.history`` leaf: the column's steps since the buffers were last cleared."""

    __slots__ = ("_column", "_steps")

    def __init__(self, column: _Column, steps: _StepCount):
        self._column = column
        self._steps = steps

    def path(self) -> tuple:
        return self._column.path

    def __len__(self) -> int:
        return self._steps.n

    def _virtual(self) -> list:
        hist = self._column.hist
        return [None] * (self._steps.n - len(hist)) + list(hist)

    def __iter__(self) -> Iterator[DataReference | None]:
        col = self._column
        for row in self._virtual():
            yield None if row is None else DataReference(col, row)

    def _one(self, i: int) -> int | None:
        """The row of step ``i``; None where the step has no data or is gone (as Reverb: too far back)."""
        n = self._steps.n
        if i >= n:
            raise IndexError("list index out of range")
        if i < 0:
            i += n
            if i < 0:
                return None
        hist = self._column.hist
        j = i - (n - len(hist))
        return hist[j] if j >= 0 else None

    def __getitem__(self, val: Any) -> TrajectoryColumn:
        col = self._column
        path = col.path + (val,)
        if isinstance(val, (int, np.integer)):
            row = self._one(int(val))
            if row is None:
                raise ValueError(f"TrajectoryColumns cannot contain any None data references: TrajectoryColumn at "
                                 f"path {path} got [None].")
            return TrajectoryColumn._of_rows(col, (row,), True, path)
        if isinstance(val, slice):
            n = self._steps.n
            start, stop, step = val.indices(n)
            hist = col.hist
            offset = n - len(hist)
            if step == 1 and start >= offset:
                if stop <= start:
                    return TrajectoryColumn._of_rows(col, (), False, path)
                first, last = hist[start - offset], hist[stop - 1 - offset]
                if first is not None and last is not None and last - first == stop - start - 1:
                    return TrajectoryColumn._of_rows(col, range(first, last + 1), False, path)
            rows = self._virtual()[val]
        elif isinstance(val, list):
            rows = [self._one(int(i)) for i in val]
        else:
            raise TypeError(f"_ColumnHistory indices must be integers or slices, not {type(val)}")
        if any(r is None for r in rows):
            raise ValueError(f"TrajectoryColumns cannot contain any None data references: TrajectoryColumn at "
                             f"path {path} got {rows}.")
        return TrajectoryColumn._of_rows(col, _as_rows(rows), False, path)

    def numpy(self) -> np.ndarray:
        return self[:].numpy()

    def __repr__(self) -> str:
        return f"_ColumnHistory(path={self._column.path}, len={len(self)})"


# -------------------------------------------------------------- encoding ----
# InsertStreamRequest bytes are written by hand around the chunks' raw buffers
# (field numbers from protos/gear/v1/replay.proto); everything else is encoded
# by protobuf and appended (concatenated messages merge).

def _chunk_head(key: int, dtype: bytes, shape: tuple, nbytes: int, episode_id: int, episode_step: int) -> bytes:
    """``InsertStreamRequest.chunks`` (field 1) holding one ChunkData, up to its raw data."""
    packed = b"".join([encode_varint(d) for d in shape])
    tensor_head = b"".join((
        b"\x0a", encode_varint(len(dtype)), dtype,            # Tensor.dtype = 1
        b"\x12", encode_varint(len(packed)), packed,          # Tensor.shape = 2 (packed)
        b"\x1a", encode_varint(nbytes),                       # Tensor.data = 3 (the raw bytes follow)
    ))
    chunk_head = b"".join((
        b"\x08", encode_varint(key),                          # ChunkData.chunk_key = 1
        b"\x18", encode_varint(episode_id),                   # ChunkData.episode_id = 3
        b"\x20", encode_varint(episode_step),                 # ChunkData.episode_step = 4
        b"\x12", encode_varint(len(tensor_head) + nbytes), tensor_head,  # ChunkData.data = 2
    ))
    return b"\x0a" + encode_varint(len(chunk_head) + nbytes) + chunk_head


def _encode_item(key: int, table: bytes, priority: float, structure: bytes,
                 columns: list[tuple[list[tuple[int, int, int]], bool]]) -> bytes:
    """``InsertStreamRequest.items`` (field 2) holding one PrioritizedItem."""
    parts = [b"\x08", encode_varint(key),                      # PrioritizedItem.key = 1
             b"\x12", encode_varint(len(table)), table,        # .table = 2
             b"\x19", _DOUBLE.pack(priority),             # .priority = 3 (fixed64)
             b"\x22", encode_varint(len(structure)), structure]  # .structure = 4
    for slices, squeeze in columns:
        body = []
        for chunk_key, offset, length in slices:
            s = b"".join((b"\x08", encode_varint(chunk_key), b"\x10", encode_varint(offset), b"\x18", encode_varint(length)))
            body += (b"\x0a", encode_varint(len(s)), s)         # ItemColumn.slices = 1
        if squeeze:
            body.append(b"\x10\x01")                      # ItemColumn.squeeze = 2
        encoded = b"".join(body)
        parts += (b"\x2a", encode_varint(len(encoded)), encoded)  # .columns = 5
    item = b"".join(parts)
    return b"\x12" + encode_varint(len(item)) + item


def _encode_releases(keys: Sequence[int]) -> bytes:
    """``InsertStreamRequest.release_chunk_keys`` (field 3, packed)."""
    if not keys:
        return b""
    packed = b"".join([encode_varint(k) for k in keys])
    return b"\x1a" + encode_varint(len(packed)) + packed


_INSERT_STREAM_METHOD = "/gear.v1.ReplayService/InsertStream"


def _open_insert_stream(client: Any) -> tuple[Any, bool]:
    """The InsertStream multicallable, and whether it takes encoded bytes.

    With the client's channel the writer sends its hand-encoded bytes as they
    are; through the stub (no channel) they are parsed into a message first.
    """
    stub = client._stub
    channel = getattr(client, "_channel", None)
    if isinstance(channel, grpc.Channel):
        return channel.stream_stream(_INSERT_STREAM_METHOD, request_serializer=None,
                                     response_deserializer=pb.InsertStreamResponse.FromString), True
    return stub.InsertStream, False


# ------------------------------------------------------------------ stream ----

class _InsertStream:
    """One InsertStream call: batched requests through a queue, acknowledgements counted by a thread.

    Requests are filled in place in ``batch``; a batch is handed to gRPC's
    request thread as soon as that thread is idle, or once it holds
    ``BATCH_BYTES`` (under load many items share one message: per-message
    costs dominate otherwise). Holds no reference to the writer, so a dropped
    writer is collected and its finalizer ends the stream.
    """

    def __init__(self, client: Any):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self.pending: dict[int, int] = {}  # item key -> bytes sent with it
        self.in_flight_bytes = 0
        self.error: BaseException | None = None
        self.done = False
        self._closing = False
        self._sender_idle = True  # gRPC's request thread waits for the next request
        self.batch: list | None = None  # pieces of the next message (bytes, or views of column buffers)
        self.batch_bytes = 0
        open_call, self._raw = _open_insert_stream(client)
        # Every message is a fresh multi-MiB bytes object (the batch joined): keep freed ones in the heap
        # so the next is not faulted in (and zeroed) page by page. Measured +3-4 % writer throughput.
        tune_allocator()
        # wait_for_ready: a daemon still starting (or restarting) is waited for, not an error.
        self._call = open_call(self._requests(), wait_for_ready=True)
        self._reader = threading.Thread(target=self._read_acks, name="gear-insert-acks", daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[pb.InsertStreamRequest]:
        q = self._queue
        while True:
            try:
                request = q.get_nowait()
            except queue.Empty:
                self._sender_idle = True
                request = q.get()
            self._sender_idle = False
            if request is None:
                return
            yield request

    def _read_acks(self) -> None:
        error: BaseException | None = None
        try:
            for response in self._call:
                with self._cond:
                    for key in response.keys:
                        self.in_flight_bytes -= self.pending.pop(key, 0)
                    self._cond.notify_all()
        except grpc.RpcError as e:
            error = e
        except BaseException as e:  # noqa: BLE001 - reported to the writer, never lost
            error = e
        finally:
            self._queue.put(None)  # unblock gRPC's request thread
            with self._cond:
                if error is None and self.pending and not self._closing:
                    error = ServiceError(f"the insert stream ended with {len(self.pending)} items unacknowledged")
                if error is not None and not self._closing:
                    self.error = error
                self.done = True
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def request(self, nbytes: int) -> list:
        """The batch (a list of encoded pieces) to extend with ``nbytes`` more (a new one when full)."""
        if self.batch is not None and self.batch_bytes + nbytes > MAX_REQUEST_BYTES:
            self.submit()
        if self.batch is None:
            self.batch = []
            self.batch_bytes = 0
        self.batch_bytes += nbytes
        return self.batch

    def added(self, key: int | None = None, nbytes: int = 0) -> None:
        """Account for what was just filled into ``batch``; send it if the sender waits or it is full."""
        if key is not None:
            with self._cond:
                self.pending[key] = nbytes
                self.in_flight_bytes += nbytes
        if self.batch_bytes >= BATCH_BYTES or self._sender_idle:
            self.submit()

    def submit(self) -> None:
        """Join the batch into one message (copying the column views) and queue it."""
        batch, self.batch = self.batch, None
        if batch:
            message = b"".join(batch)
            self._sender_idle = False
            self._queue.put(message if self._raw else pb.InsertStreamRequest.FromString(message))

    def wait(self, max_items: int, max_bytes: int, deadline: float | None) -> bool:
        """Block until at most max_items (and max_bytes) are in flight; False on timeout.

        Returns True early when the stream failed or ended (the caller checks ``error``).
        """
        if len(self.pending) > max_items or (self.pending and self.in_flight_bytes > max_bytes):
            self.submit()  # what we wait for may sit in the batch (acks only lower the counts)
        with self._cond:
            while len(self.pending) > max_items or (self.pending and self.in_flight_bytes > max_bytes):
                if self.done or self.error is not None:
                    return True
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(remaining)
            return True

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Half-close; cancel if the server has not finished within ``timeout``."""
        self.submit()
        self._queue.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            with self._cond:
                self._closing = True
            self._call.cancel()
            self._reader.join(timeout)

    def abort(self) -> None:
        """Cancel at once (after an error, or when the writer is dropped); once only.

        A writer dropped at interpreter exit is aborted twice (by its finalizer at
        exit, then by ``__del__``), and gRPC calls made while the interpreter
        finalizes can block forever.
        """
        with self._cond:
            if self._closing:
                return  # aborted already, or cancelled by close()
            self._closing = True
        self.batch = None
        self._queue.put(None)
        self._call.cancel()


def _close_stream(stream: _InsertStream | None) -> None:
    if stream is not None and not stream.done:
        stream.abort()


# ------------------------------------------------------------------ writer ----

class _AppendPlan:
    """Cached flattening of one data layout (a flat dict/tuple of leaves) to columns."""

    __slots__ = ("columns", "missing", "getter")

    def __init__(self, columns: list[_Column], missing: list[_Column], getter: Any):
        self.columns = columns
        self.missing = missing
        self.getter = getter  # data -> values in column order; None: the sequence itself


_LEAF = object()


class TrajectoryWriter:
    """Reverb's TrajectoryWriter (see the module docstring for the wire protocol).

    Construct it with ``client.trajectory_writer(num_keep_alive_refs)``.
    """

    def __init__(self, client: Any, num_keep_alive_refs: int, *, validate_items: bool = True,
                 max_in_flight_items: int = DEFAULT_MAX_IN_FLIGHT_ITEMS,
                 max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES):
        if int(num_keep_alive_refs) < 1:
            raise ValueError(f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer")
        if int(max_in_flight_items) < 1:
            raise ValueError(f"max_in_flight_items ({max_in_flight_items}) must be a positive integer")
        self._client = client
        self._keep = int(num_keep_alive_refs)
        self._validate_items = bool(validate_items)
        self._max_in_flight = int(max_in_flight_items)
        self._max_in_flight_bytes = int(max_in_flight_bytes)
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._episode_id = self._new_id()
        self._columns: list[_Column] = []
        self._by_path: dict[tuple, _Column] = {}
        self._skeleton: Any = None  # union of appended structures, leaves = _LEAF
        self._history: Any = None  # cached history nest
        self._dict_plans: dict[tuple, _AppendPlan] = {}  # dict keys in insertion order -> plan
        self._seq_plans: dict[tuple, _AppendPlan] = {}  # (sequence type, length) -> plan
        self._column_config: dict[tuple, tuple[int, int | None]] = {}
        self._open = False  # last step opened with partial_step=True
        self._hist_len = _StepCount()  # steps since the buffers were last cleared
        self._step = -1  # episode step of the last (possibly open) step
        self._episode_steps = 0  # completed steps this episode
        self._stream: _InsertStream | None = None
        self._unsent = False  # the stream's batch holds data not yet handed to gRPC
        self._finalizer = weakref.finalize(self, _close_stream, None)
        self._chunk_counter = itertools.count(1)
        self._pending_release: list[int] = []
        self._table_infos: dict[str, pb.TableInfo] = {}
        self._validated: dict[Any, bool] = {}
        self._structures: dict[Any, bytes] = {}  # treedef -> encoded gear.v1.Structure

    # ----------------------------------------------------------- context --
    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, tb: Any) -> None:
        try:
            if exc_type is None or not issubclass(exc_type, ReverbError):
                self.flush()
        finally:
            self.close()

    def __del__(self) -> None:
        try:
            self.close(_wait=False)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # ------------------------------------------------------------ public --
    @property
    def history(self) -> Any:
        """The appended steps per column, structured like the appended data."""
        if not self._columns:
            raise RuntimeError("history cannot be accessed before `append` is called at least once.")
        if self._history is None:
            self._history = self._build_history(self._skeleton, ())
        return self._history

    @property
    def episode_steps(self) -> int:
        """Completed ``append`` calls (partial ones not counted) since the last ``end_episode``."""
        return self._episode_steps

    @property
    def max_num_keep_alive_refs(self) -> int:
        return max([self._keep] + [c.keep for c in self._columns])

    def configure(self, path: tuple, *, num_keep_alive_refs: int, max_chunk_length: int | None) -> None:
        """Override the keep-alive window (and the chunk length) of one column."""
        if not isinstance(path, tuple):
            raise TypeError(f"path must be a tuple, got {type(path)}")
        if num_keep_alive_refs < 1:
            raise ValueError(f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer")
        if max_chunk_length is not None and (max_chunk_length < 1 or max_chunk_length > num_keep_alive_refs):
            raise ValueError(f"max_chunk_length ({max_chunk_length}) must be None or a positive integer <= "
                             f"num_keep_alive_refs ({num_keep_alive_refs})")
        self._column_config[path] = (int(num_keep_alive_refs), max_chunk_length)
        column = self._by_path.get(path)
        if column is not None:
            self._apply_config(column)  # a new buffer, if any: chunk views keep the old one alive

    def append(self, data: Any, *, partial_step: bool = False) -> None:
        """Append one step (or part of it, with ``partial_step``) column-wise."""
        # Fast path: a flat dict/sequence of leaves laid out as before, with the
        # same dtypes and shapes, starting a new step. Validated before any change.
        if type(data) is dict:
            plan = self._dict_plans.get(tuple(data))
        else:
            plan = self._seq_plans.get((type(data), len(data))) if isinstance(data, (list, tuple)) else None
        if plan is not None and not self._open:
            getter = plan.getter
            values = data if getter is None else getter(data)
            columns = plan.columns
            for column, x in zip(columns, values):  # noqa: B905 - same length by construction
                if type(x) is np.ndarray:
                    if x.shape != column.shape or x.dtype != column.dtype:
                        break
                elif type(x) not in column.fast_types:
                    break
            else:
                self._step = step = self._step + 1
                self._hist_len.n += 1
                for column, x in zip(columns, values):  # noqa: B905
                    row = column.nrows
                    pos = row - column.buf_first_row
                    if pos >= column.cap:
                        pos = column.compact(self._release_views)
                    column.buf[pos] = x
                    column.row_step[pos] = step
                    column.hist.append(row)
                    column.nrows = row + 1
                for column in plan.missing:
                    column.hist.append(None)
                if partial_step:
                    self._open = True
                else:
                    self._episode_steps += 1
                if self._unsent:
                    self._send_if_idle()
                return
        columns, values, missing = self._flatten_generic(data)
        self._commit(columns, values, missing, partial_step)
        if self._unsent:
            self._send_if_idle()

    def _send_if_idle(self) -> None:
        """Send a batch left waiting for a busy sender once the sender is free."""
        stream = self._stream
        if stream is None or stream.batch is None:
            self._unsent = False
        elif stream._sender_idle:
            stream.submit()
            self._unsent = False

    def create_item(self, table: str, priority: float, trajectory: Any) -> None:
        """Send an item of ``table`` made of the trajectory's columns (blocks past max_in_flight_items)."""
        flat, treedef = nest.flatten_with_treedef(trajectory)
        for column in flat:
            if not isinstance(column, TrajectoryColumn):
                raise TypeError(f"All leaves of `trajectory` must be `TrajectoryColumn` but got {trajectory}")
        if not flat:
            raise ValueError("trajectory must contain at least one column")
        for i, column in enumerate(flat):
            if len(column) == 0:
                raise ValueError(f"trajectory column {i} is empty: every column needs at least one step")
        try:
            priority = float(priority)
        except (TypeError, ValueError) as e:
            raise ValueError(f"priority must be a number, got {priority!r}") from e
        if math.isnan(priority):
            raise ValueError("priority must not be NaN")
        if priority < 0:
            raise ValueError(f"priority must not be negative, got {priority}")
        if not isinstance(table, str) or not table:
            raise ValueError(f"table must be a non-empty string, got {table!r}")
        for i, column in enumerate(flat):
            if not column._check_alive():
                raise ValueError(f"trajectory column {i} references data that has expired (older than "
                                 f"num_keep_alive_refs steps, or cleared by end_episode)")
            for col, _ in column._segments:
                if self._by_path.get(col.path) is not col:
                    raise ValueError(f"trajectory column {i} references data of another writer")
        specs = self._column_specs(flat)
        if self._validate_items:
            self._validate(table, flat, specs)
        structure = self._structures.get(treedef)
        if structure is None:
            structure = nest.structure_of(trajectory).SerializeToString()
            if len(self._structures) > 256:
                self._structures.clear()
            self._structures[treedef] = structure

        stream = self._ready_stream("create_item")
        if not stream.wait(self._max_in_flight - 1, self._max_in_flight_bytes, None):
            raise DeadlineExceededError("create_item: timed out waiting for in-flight items")
        self._raise_stream_error("create_item")

        chunks: list[_Chunk] = []
        item_columns = []
        for column in flat:
            slices: list[tuple[int, int, int]] = []
            for col, rows in column._segments:
                self._slices_for(col, rows, chunks, slices)
            item_columns.append((_merge_slices(slices), column.is_squeezed))
        self._collect_releases()
        self._send(stream, chunks, self._new_id(), table, priority, structure, item_columns)

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Block until at most ``block_until_num_items`` items are unacknowledged by the server."""
        if block_until_num_items < 0:
            raise ValueError(f"block_until_num_items must be >= 0, got {block_until_num_items}")
        self._raise_stream_error("flush")
        stream = self._stream
        if stream is None:
            return
        self._collect_releases()
        if self._pending_release:
            stream.request(0).append(_encode_releases(self._take_releases()))
        stream.submit()
        self._unsent = False
        deadline = None if timeout_ms is None or timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0
        ok = stream.wait(block_until_num_items, 1 << 62, deadline)
        self._raise_stream_error("flush")
        if not ok:
            raise DeadlineExceededError(
                f"flush did not complete within {timeout_ms} ms ({stream.in_flight} items still in flight)")

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Flush, then start a new episode (and forget the history with ``clear_buffers``).

        The episode is reset even when the flush times out (DeadlineExceededError).
        """
        try:
            self.flush(0, timeout_ms)
        finally:
            self._episode_id = self._new_id()
            self._open = False
            self._step = -1
            self._episode_steps = 0
            for column in self._columns:
                if clear_buffers:
                    column.clear(self._episode_id)
                else:
                    column.episode_marks.append((column.nrows, self._episode_id))
                    column.drop_dead_marks()
            if clear_buffers:
                self._hist_len.n = 0
                self._release_all_chunks()
                if self._stream is not None and not self._stream.done and self._pending_release:
                    self._stream.request(0).append(_encode_releases(self._take_releases()))
                    self._stream.submit()

    def close(self, _wait: bool = True) -> None:
        """End the stream (items not yet acknowledged may be lost; ``flush`` first to keep them)."""
        stream, self._stream = self._stream, None
        self._finalizer.detach()
        if stream is not None:
            if _wait:
                stream.close()
            else:
                stream.abort()
        self._reset_chunks()

    # ---------------------------------------------------------- appending --
    def _flatten_generic(self, data: Any) -> tuple[list[_Column], list[Any], list[_Column]]:
        pairs = nest.flatten_with_paths(data, none_is_leaf=True)
        if not pairs:
            raise ValueError("append needs at least one field")
        columns, values = [], []
        new_paths = []
        for path, value in pairs:
            column = self._by_path.get(path)
            if column is None:
                self._check_new_path(path)
                new_paths.append(path)
            columns.append(path)
            values.append(value)
        if new_paths:
            self._grow(data, new_paths)
        columns = [self._by_path[p] for p in columns]
        seen = {id(c) for c, v in zip(columns, values, strict=True) if v is not None}
        present = [(c, v) for c, v in zip(columns, values, strict=True) if v is not None]
        converted = [c.convert(v) for c, v in present]
        missing = [c for c in self._columns if id(c) not in seen]
        cols = [c for c, _ in present]
        self._maybe_cache_plan(data, cols, missing, len(pairs) == len(present))
        return cols, converted, missing

    def _maybe_cache_plan(self, data: Any, columns: list[_Column], missing: list[_Column], complete: bool) -> None:
        """Cache the layout of flat data (every field a leaf with data) for the fast path."""
        if not complete or any(c.dtype is None for c in columns):
            return
        t = type(data)
        if t is dict:
            if any(nest.is_nested(v) for v in data.values()) or len(self._dict_plans) > 64:
                return
            keys = sorted(data)
            if len(keys) == 1:
                key = keys[0]

                def getter(d: dict) -> tuple:
                    return (d[key],)
            else:
                getter = operator.itemgetter(*keys)
            self._dict_plans[tuple(data)] = _AppendPlan(columns, missing, getter)
        elif isinstance(data, (list, tuple)):
            if any(nest.is_nested(v) for v in data) or len(self._seq_plans) > 64:
                return
            self._seq_plans[(t, len(data))] = _AppendPlan(columns, missing, None)

    def _check_new_path(self, path: tuple) -> None:
        n = len(path)
        for other in self._by_path:
            m = len(other)
            if (m < n and path[:m] == other) or (n < m and other[:n] == path):
                raise ValueError(f"field {_format_path(path)} conflicts with field {_format_path(other)}: a leaf "
                                 f"cannot become a nest (or the reverse)")

    def _grow(self, data: Any, new_paths: list[tuple]) -> None:
        padding = self._hist_len.n
        for path in new_paths:
            column = _Column(path, len(self._columns), self._keep, padding, self._episode_id)
            self._columns.append(column)
            self._by_path[path] = column
            self._apply_config(column)
        self._skeleton = _union(self._skeleton, data)
        self._history = None
        self._dict_plans.clear()
        self._seq_plans.clear()

    def _apply_config(self, column: _Column) -> None:
        config = self._column_config.get(column.path)
        if config is not None:
            column.set_keep(config[0])
            column.max_chunk_length = config[1]

    def _commit(self, columns: list[_Column], values: Sequence[Any], missing: list[_Column],
                partial_step: bool) -> None:
        if self._open:
            for column in columns:
                if not column.hist or column.hist[-1] is not None:
                    raise ValueError(
                        f"Field {column.name} has already been set in the active step by previous (partial) append "
                        f"call and thus must be omitted or set to None")
            step = self._step
            for column, x in zip(columns, values, strict=True):
                row = self._store(column, x, step)
                column.hist[-1] = row
        else:
            self._step = step = self._step + 1
            self._hist_len.n += 1
            for column, x in zip(columns, values, strict=True):
                row = column.nrows
                column.hist.append(row)
                pos = row - column.buf_first_row
                if pos >= column.cap:
                    pos = column.compact(self._release_views)
                column.buf[pos] = x
                column.row_step[pos] = step
                column.nrows = row + 1
            for column in missing:
                column.hist.append(None)
        self._open = partial_step
        if not partial_step:
            self._episode_steps += 1

    def _store(self, column: _Column, x: Any, step: int) -> int:
        row = column.nrows
        column.nrows = row + 1
        pos = row - column.buf_first_row
        if pos >= column.cap:
            pos = column.compact(self._release_views)
        column.buf[pos] = x
        column.row_step[pos] = step
        return row

    def _build_history(self, skeleton: Any, path: tuple) -> Any:
        if skeleton is _LEAF:
            return _ColumnHistory(self._by_path[path], self._hist_len)
        if isinstance(skeleton, dict):
            return {k: self._build_history(v, path + (k,)) for k, v in skeleton.items()}
        if nest.is_namedtuple(skeleton):
            return type(skeleton)(*[self._build_history(v, path + (i,)) for i, v in enumerate(skeleton)])
        if isinstance(skeleton, (list, tuple)):
            return type(skeleton)(self._build_history(v, path + (i,)) for i, v in enumerate(skeleton))
        return None

    # ------------------------------------------------------------- items --
    @staticmethod
    def _column_specs(flat: list[TrajectoryColumn]) -> list[tuple[np.dtype, tuple]]:
        specs = []
        for i, column in enumerate(flat):
            first = column._segments[0][0]
            for col, _ in column._segments[1:]:
                if col.dtype != first.dtype or col.shape != first.shape:
                    raise ValueError(f"trajectory column {i} mixes data of dtype/shape {first.dtype}{first.shape} "
                                     f"and {col.dtype}{col.shape}")
            specs.append((first.dtype, column.shape))
        return specs

    def _table_info(self, table: str, refresh: bool = False) -> pb.TableInfo:
        info = None if refresh else self._table_infos.get(table)
        if info is None:
            info = self._client._table_info(table, refresh=True) if refresh else self._client._table_info(table)
            self._table_infos[table] = info
        return info

    def _validate(self, table: str, flat: list[TrajectoryColumn], specs: list[tuple[np.dtype, tuple]]) -> None:
        """Check the table exists and the item fits its signature (ValueError naming the table)."""
        cache_key = (table, tuple((dt.str, shape) for dt, shape in specs))
        if cache_key in self._validated:
            return
        problem = _signature_problem(table, self._table_info(table), specs)
        if problem is not None:
            # The cached info may be stale (e.g. the server at this address was
            # restarted with other tables): look again before refusing.
            problem = _signature_problem(table, self._table_info(table, refresh=True), specs)
            if problem is not None:
                raise ValueError(problem)
        if len(self._validated) > 1024:
            self._validated.clear()
        self._validated[cache_key] = True

    def _slices_for(self, col: _Column, rows: Sequence[int], chunks: list[_Chunk],
                    slices: list[tuple[int, int, int]]) -> None:
        """Append the (chunk, offset, length) slices covering ``rows``; send the unsent rows as chunks."""
        if isinstance(rows, range) and rows.step == 1:
            runs = [(rows.start, rows.stop)]
        else:
            runs = []
            for r in rows:
                if runs and runs[-1][1] == r:
                    runs[-1] = (runs[-1][0], r + 1)
                else:
                    runs.append((r, r + 1))
        for start, stop in runs:
            self._cover(col, start, stop, chunks, slices)

    def _cover(self, col: _Column, start: int, stop: int, chunks: list[_Chunk],
               slices: list[tuple[int, int, int]]) -> None:
        live_chunks, firsts = col.chunks, col.chunk_firsts
        i = max(0, bisect.bisect_right(firsts, start) - 1)
        pos = start
        while pos < stop:
            if i < len(live_chunks) and live_chunks[i][0] <= pos < live_chunks[i][1]:
                first, end, key = live_chunks[i]
                n = min(stop, end) - pos
                slices.append((key, pos - first, n))
                pos += n
                i += 1
                continue
            if i < len(live_chunks) and live_chunks[i][1] <= pos:
                i += 1
                continue
            # Rows [pos, gap_end) are not on the server yet: send them.
            gap_end = stop
            if i < len(live_chunks):
                gap_end = min(gap_end, live_chunks[i][0])
            for first, end, key in self._new_chunks(col, pos, gap_end, chunks):
                entry = [first, end, key]
                j = bisect.bisect_left(firsts, first)
                live_chunks.insert(j, entry)
                firsts.insert(j, first)
                slices.append((key, 0, end - first))
                i = j + 1
            pos = gap_end

    def _new_chunks(self, col: _Column, start: int, stop: int, out: list[_Chunk]) -> list[tuple[int, int, int]]:
        made = []
        max_rows = max(1, MAX_CHUNK_BYTES // col.row_bytes)
        if col.max_chunk_length:
            max_rows = min(max_rows, col.max_chunk_length)
        pos = start
        while pos < stop:
            episode_id, next_episode = col.episode_of(pos)
            end = min(stop, pos + max_rows, next_episode)
            key = next(self._chunk_counter)
            rows = col.rows_array(pos, end)
            data = memoryview(rows.reshape(-1).view(np.uint8))  # any dtype, no copy (rows are contiguous)
            head = _chunk_head(key, col.dtype_wire, rows.shape, data.nbytes, episode_id,
                                   col.row_step[pos - col.buf_first_row])
            out.append((head, data))
            made.append((pos, end, key))
            pos = end
        return made

    def _collect_releases(self) -> None:
        """Queue the keys of chunks whose rows can no longer be referenced."""
        for col in self._columns:
            if not col.chunks:
                continue
            live = col.min_live_row()
            chunks = col.chunks
            n = 0
            while n < len(chunks) and chunks[n][1] <= live:
                self._pending_release.append(chunks[n][2])
                n += 1
            if n:
                del chunks[:n]
                del col.chunk_firsts[:n]
                col.drop_dead_marks()

    def _release_all_chunks(self) -> None:
        for col in self._columns:
            self._pending_release.extend(c[2] for c in col.chunks)
            col.chunks.clear()
            col.chunk_firsts.clear()

    def _take_releases(self) -> list[int]:
        keys, self._pending_release = self._pending_release, []
        return keys

    def _send(self, stream: _InsertStream, chunks: list[_Chunk], key: int, table: str, priority: float,
              structure: bytes, item_columns: list[tuple[list[tuple[int, int, int]], bool]]) -> None:
        """Put the new chunks, then the item (and pending releases) into the stream's batch.

        Chunks are encoded by hand around their raw buffers (no copy until the
        batch is joined into one message); the small item part is an encoded
        InsertStreamRequest appended after them (protobuf concatenation merges).
        """
        nbytes = sum(len(head) + data.nbytes for head, data in chunks)
        remaining = nbytes
        # Chunks beyond one request's worth go first, in requests of their own.
        while remaining > MAX_REQUEST_BYTES and len(chunks) > 1:
            size = 0
            pieces = []
            while len(chunks) > 1 and (not pieces or size + len(chunks[0][0]) + chunks[0][1].nbytes
                                       <= MAX_REQUEST_BYTES):
                head, data = chunks.pop(0)
                pieces += (head, data)
                size += len(head) + data.nbytes
            stream.request(size).extend(pieces)
            stream.submit()
            remaining -= size
        encoded = _encode_item(key, table.encode(), priority, structure, item_columns)
        if self._pending_release:
            encoded += _encode_releases(self._take_releases())
        pieces = stream.request(remaining + len(encoded))
        for head, data in chunks:
            pieces += (head, data)
        pieces.append(encoded)
        stream.added(key, nbytes)
        self._unsent = stream.batch is not None

    # ------------------------------------------------------------ stream --
    def _ready_stream(self, operation: str) -> _InsertStream:
        self._raise_stream_error(operation)
        stream = self._stream
        if stream is None or stream.done:
            self._reset_chunks()
            try:
                stream = self._stream = _InsertStream(self._client)
            except grpc.RpcError as e:
                raise from_rpc_error(e, operation) from e
            except (ValueError, RuntimeError) as e:  # e.g. the client's channel was closed
                raise ServiceError(f"{operation}: cannot open the insert stream: {e}") from e
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close_stream, stream)
        return stream

    def _release_views(self, column: _Column, target: np.ndarray) -> None:
        """Send the pending batch if it holds views of ``target``, a buffer about to be overwritten.

        Chunks are views of column buffers until their batch is joined into a
        message (see ``_Column.compact``).
        """
        stream = self._stream
        if stream is None or not stream.batch:
            return
        start = target.ctypes.data
        end = start + target.nbytes
        for piece in stream.batch:
            if type(piece) is memoryview:
                address = piece.obj.ctypes.data
                if address < end and address + piece.nbytes > start:
                    stream.submit()
                    return

    def _raise_stream_error(self, operation: str) -> None:
        stream = self._stream
        if stream is None or stream.error is None:
            return
        error = stream.error
        lost = stream.in_flight
        self._stream = None
        self._finalizer.detach()
        stream.abort()
        self._reset_chunks()
        if isinstance(error, grpc.RpcError):
            raise from_rpc_error(error, operation) from error
        if isinstance(error, Exception) and lost and not isinstance(error, ServiceError):
            raise ServiceError(f"{operation}: the insert stream failed: {error}") from error
        raise error

    def _reset_chunks(self) -> None:
        """Forget what the server holds (a new stream starts empty)."""
        for col in self._columns:
            col.chunks.clear()
            col.chunk_firsts.clear()
        self._pending_release.clear()

    def _new_id(self) -> int:
        return self._rng.getrandbits(64) or 1


def _signature_problem(table: str, info: pb.TableInfo, specs: list[tuple[np.dtype, tuple]]) -> str | None:
    """Why an item of these column specs does not fit the table's signature (None: it fits)."""
    if not info.HasField("signature") or not len(info.signature.leaves):
        return None
    expected = signature_specs(info.signature)
    if len(expected) != len(specs):
        return (f"Unable to create item in table '{table}': the trajectory has {len(specs)} columns but the table "
                f"signature has {len(expected)}")
    for i, ((dtype, shape), spec) in enumerate(zip(specs, expected, strict=True)):
        if dtype != spec.dtype or not shape_compatible(spec.shape, shape):
            label = spec.name or f"column {i}"
            return (f"Unable to create item in table '{table}': {label} has dtype {dtype} and shape {list(shape)} "
                    f"but the table signature expects dtype {spec.dtype} and shape {list(spec.shape)}")
    return None


def _merge_slices(slices: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join slices that continue each other within one chunk."""
    merged: list[list[int]] = []
    for key, offset, length in slices:
        if merged and merged[-1][0] == key and merged[-1][1] + merged[-1][2] == offset:
            merged[-1][2] += length
        else:
            merged.append([key, offset, length])
    return [(k, o, n) for k, o, n in merged]


def _union(skeleton: Any, data: Any) -> Any:
    """The union of a structure skeleton (leaves ``_LEAF``) and a data nest's structure."""
    if data is None or not nest.is_nested(data):
        return _LEAF if skeleton is None else skeleton
    if skeleton is None:
        skeleton = type(data)() if isinstance(data, dict) else None
    if isinstance(data, dict) or (hasattr(data, "keys") and not isinstance(data, (list, tuple))):
        merged = dict(skeleton) if isinstance(skeleton, dict) else {}
        for k in sorted(data):
            merged[k] = _union(merged.get(k), data[k])
        return dict(sorted(merged.items()))
    items = list(data)
    old = list(skeleton) if isinstance(skeleton, (list, tuple)) else []
    parts = [_union(old[i] if i < len(old) else None, items[i] if i < len(items) else None)
             for i in range(max(len(old), len(items)))]
    if nest.is_namedtuple(data):
        return type(data)(*parts)
    if nest.is_namedtuple(skeleton):
        return type(skeleton)(*parts)
    return type(data)(parts)
