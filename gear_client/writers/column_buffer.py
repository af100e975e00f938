"""One appended field's recent rows, in a contiguous buffer, with its history and its chunks' bookkeeping.

A writer keeps one ``ColumnBuffer`` per leaf path of the appended nests. Rows
are numbered per column from 0; row ``r`` lives at ``buf[r - buf_first_row]``,
so any run of rows an item needs is one slice. Two buffers take turns when the
live rows are moved to the front (``compact``): chunks waiting to be sent are
views of the current one.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ColumnBuffer", "ColumnMismatchError", "format_path"]

# Spare rows kept beyond the keep-alive window so the buffer is compacted rarely.
_SPARE_BUFFER_BYTES = 1 << 20
_MAX_SPARE_ROWS = 4096

_PY_SCALAR_DTYPES = {float: np.dtype(np.float64), int: np.dtype(np.int64), bool: np.dtype(np.bool_)}

# Called with (column, buffer) before ``buffer`` is overwritten by a compaction.
BeforeMove = Callable[["ColumnBuffer", np.ndarray], None]


def format_path(path: tuple) -> str:
    """A field's path as users index it: ``['obs'][0]`` (``<root>`` for a bare leaf)."""
    return "".join(f"[{p!r}]" for p in path) if path else "<root>"


class ColumnMismatchError(ValueError):
    """A step's value whose dtype or shape is not its column's (fixed by the first value): ``path``, ``dtype``,
    ``shape`` (given) and ``expected_dtype``, ``expected_shape`` say which."""

    def __init__(self, message: str, path: tuple, dtype: np.dtype, shape: tuple, expected_dtype: np.dtype,
                 expected_shape: tuple):
        super().__init__(message)
        self.path, self.dtype, self.shape = path, dtype, shape
        self.expected_dtype, self.expected_shape = expected_dtype, expected_shape


class ColumnBuffer:
    """One leaf path's recent rows, their history per step, and the chunks that carry them.

    ``hist`` holds the row of each of the last ``keep`` steps (None where the
    step had no data for this column). ``chunks`` lists the live chunks sorted,
    as ``[first_row, end_row, chunk_key]`` (``chunk_firsts`` mirrors first_row).
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
        self.chunks: list[list[int]] = []
        self.chunk_firsts: list[int] = []
        # (first row, episode id) of each episode whose rows may still be alive.
        self.episode_marks: list[tuple[int, int]] = [(0, episode_id)]
        self.row_bytes = 0

    @property
    def name(self) -> str:
        return format_path(self.path)

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
            raise ColumnMismatchError(
                f"column {self.name}: expected dtype {self.dtype} and shape {self.shape}, got dtype "
                f"{arr.dtype} and shape {arr.shape}", self.path, arr.dtype, arr.shape, self.dtype, self.shape)
        return arr

    def store(self, value: Any, step: int, before_move: BeforeMove | None) -> int:
        """Write one row (the step's value) after the last; returns its row number."""
        row = self.nrows
        pos = row - self.buf_first_row
        if pos >= self.cap:
            pos = self.compact(before_move)
        self.buf[pos] = value
        self.row_step[pos] = step
        self.nrows = row + 1
        return row

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
        # Rows are allocated as they come (``compact`` grows the buffer up to ``_full_cap``), so a
        # huge keep-alive window costs nothing until it fills.
        self._allocate(min(self._full_cap(), 2 * self._spare_rows()))

    def _spare_rows(self) -> int:
        """Rows kept beyond the live ones so compactions are rare: about 1 MiB worth (16 to 4096 rows)."""
        return min(_MAX_SPARE_ROWS, max(16, _SPARE_BUFFER_BYTES // self.row_bytes))

    def _full_cap(self) -> int:
        """The most rows the buffer grows to: the keep-alive window plus as many spare rows (or more)."""
        return self.keep + max(self.keep, self._spare_rows())

    def _allocate(self, cap: int) -> None:
        """Move the live rows into a new buffer of ``cap`` rows (at least the live rows plus one)."""
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

    def compact(self, before_move: BeforeMove | None = None) -> int:
        """Move the live rows to the front of the other buffer; returns the position of the next row.

        While the live rows fill half the buffer and it is smaller than ``_full_cap``,
        they move into a new buffer of twice the rows instead (rows are allocated as
        they are appended, amortized O(1) per row).

        Two buffers take turns, so rows of the current one stay where they are
        (chunks waiting in a batch are views of them). ``before_move(column,
        target)`` is called before ``target`` is overwritten.
        """
        live = self.min_live_row()
        src = live - self.buf_first_row
        n = self.nrows - live
        if 2 * n >= self.cap and self.cap < self._full_cap():  # live rows fill half of it: grow (doubling)
            self._allocate(max(n + 1, min(self._full_cap(), 2 * self.cap)))
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
        self.keep = keep  # a larger window grows the buffer as rows come (``compact``)

    def clear(self, episode_id: int) -> None:
        """Forget every row (end_episode with clear_buffers); chunks are released by the writer."""
        self.hist.clear()
        self.episode_marks = [(self.nrows, episode_id)]

    def start_episode(self, episode_id: int) -> None:
        """Rows from now on belong to a new episode (end_episode keeping the buffers)."""
        self.episode_marks.append((self.nrows, episode_id))
        self.drop_dead_marks()

    def drop_dead_marks(self) -> None:
        live = self.min_live_row()
        marks = self.episode_marks
        while len(marks) > 1 and marks[1][0] <= live:
            marks.pop(0)
