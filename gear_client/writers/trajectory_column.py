"""References to appended steps: ``DataReference``, ``TrajectoryColumn`` and the writer's ``history`` views.

An item is built from ``TrajectoryColumn``s: runs of rows of a column buffer
(a ``range`` when consecutive, the common case). ``writer.history[...]`` leaves
are ``ColumnHistory`` views that index the column's steps like a list.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from gear_client.writers.column_buffer import ColumnBuffer

__all__ = ["ColumnHistory", "DataReference", "StepCount", "TrajectoryColumn", "as_rows"]


class DataReference:
    """A reference to one step of one column (Reverb's ``WeakCellRef``)."""

    __slots__ = ("_column", "_row")

    def __init__(self, column: ColumnBuffer, row: int):
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

    __slots__ = ("segments", "_len", "is_squeezed", "_path")

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
        segments: list[tuple[ColumnBuffer, list[int]]] = []
        for ref in refs:
            if segments and segments[-1][0] is ref._column:
                segments[-1][1].append(ref._row)
            else:
                segments.append((ref._column, [ref._row]))
        self.segments = [(c, as_rows(r)) for c, r in segments]
        self._len = len(refs)
        self.is_squeezed = bool(squeeze)
        self._path = path

    @classmethod
    def of_rows(cls, column: ColumnBuffer, rows: Sequence[int], squeeze: bool, path: tuple | None) -> TrajectoryColumn:
        self = cls.__new__(cls)
        self.segments = [(column, rows)] if len(rows) else []
        self._len = len(rows)
        self.is_squeezed = squeeze
        self._path = path
        return self

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[DataReference]:
        for column, rows in self.segments:
            for r in rows:
                yield DataReference(column, r)

    def __getitem__(self, val: Any) -> TrajectoryColumn:
        if len(self.segments) == 1:
            column, rows = self.segments[0]
            if isinstance(val, (int, np.integer)):
                return TrajectoryColumn.of_rows(column, [rows[val]], True, None)
            if isinstance(val, slice):
                return TrajectoryColumn.of_rows(column, rows[val], False, None)
            if isinstance(val, list):
                return TrajectoryColumn.of_rows(column, as_rows([rows[i] for i in val]), False, None)
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
        step_shape = self.segments[0][0].shape if self.segments else ()
        return tuple(step_shape) if self.is_squeezed else (self._len, *step_shape)

    @property
    def dtype(self) -> np.dtype | None:
        return self.segments[0][0].dtype if self.segments else None

    def is_alive(self) -> bool:
        for column, rows in self.segments:
            if min(rows) < column.min_live_row():
                return False
        return True

    def numpy(self) -> np.ndarray:
        """The referenced steps stacked (one step without time dimension when squeezed)."""
        if not self.is_alive():
            raise RuntimeError("Cannot convert TrajectoryColumn with expired data references to numpy array.")
        parts = []
        for column, rows in self.segments:
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


def as_rows(rows: list[int]) -> Sequence[int]:
    """A range when the rows are consecutive (the common case), else the list."""
    n = len(rows)
    if n and rows[-1] - rows[0] == n - 1 and all(b - a == 1 for a, b in itertools.pairwise(rows)):
        return range(rows[0], rows[-1] + 1)
    return rows


class StepCount:
    """Steps in the history since the buffers were last cleared (shared with the history views)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class ColumnHistory:
    """``writer.history`` leaf: the column's steps since the buffers were last cleared."""

    __slots__ = ("_column", "_steps")

    def __init__(self, column: ColumnBuffer, steps: StepCount):
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
            return TrajectoryColumn.of_rows(col, (row,), True, path)
        if isinstance(val, slice):
            n = self._steps.n
            if val.start is not None and val.start < -n:  # Reverb pads the missing steps with None refs
                raise ValueError(f"TrajectoryColumns cannot contain any None data references: TrajectoryColumn at "
                                 f"path {path} starts {-val.start} steps back, but the history holds {n} steps.")
            start, stop, step = val.indices(n)
            hist = col.hist
            offset = n - len(hist)
            if step == 1 and start >= offset:
                if stop <= start:
                    return TrajectoryColumn.of_rows(col, (), False, path)
                first, last = hist[start - offset], hist[stop - 1 - offset]
                if first is not None and last is not None and last - first == stop - start - 1:
                    return TrajectoryColumn.of_rows(col, range(first, last + 1), False, path)
            rows = self._virtual()[val]
        elif isinstance(val, list):
            rows = [self._one(int(i)) for i in val]
        else:
            raise TypeError(f"ColumnHistory indices must be integers or slices, not {type(val)}")
        if any(r is None for r in rows):
            raise ValueError(f"TrajectoryColumns cannot contain any None data references: TrajectoryColumn at "
                             f"path {path} got {rows}.")
        return TrajectoryColumn.of_rows(col, as_rows(rows), False, path)

    def numpy(self) -> np.ndarray:
        return self[:].numpy()

    def __repr__(self) -> str:
        return f"ColumnHistory(path={self._column.path}, len={len(self)})"
