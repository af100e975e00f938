"""How appended steps map onto a writer's columns: one column per leaf path, the structure, the history nest.

New leaf paths add columns (padded with empty steps); flat dicts and
sequences laid out as before take a cached ``AppendPlan`` (the append fast
path); ``history`` is a nest shaped like the union of every appended
structure whose leaves are ``ColumnHistory`` views.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from gear_client.writers.column_buffer import ColumnBuffer, format_path
from gear_client.writers.trajectory_column import ColumnHistory, StepCount
from gear_contract import nest

__all__ = ["AppendPlan", "StepLayout"]

_MAX_PLANS = 64


class _Leaf:
    """The leaves of a structure skeleton."""


_LEAF = _Leaf()


class AppendPlan:
    """Cached flattening of one data layout (a flat dict/tuple of leaves) to columns."""

    __slots__ = ("columns", "missing", "getter")

    def __init__(self, columns: list[ColumnBuffer], missing: list[ColumnBuffer],
                 getter: Callable[[Any], Any] | None):
        self.columns = columns
        self.missing = missing
        self.getter = getter  # data -> values in column order; None: the sequence itself


class StepLayout:
    """A writer's columns by leaf path, the union of the appended structures, and the append plans."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.columns: list[ColumnBuffer] = []
        self.by_path: dict[tuple, ColumnBuffer] = {}
        self.column_config: dict[tuple, tuple[int, int | None]] = {}
        self._skeleton: Any = None  # union of appended structures, leaves = _LEAF
        self._history: Any = None  # cached history nest
        self._dict_plans: dict[tuple, AppendPlan] = {}  # dict keys in insertion order -> plan
        self._seq_plans: dict[tuple, AppendPlan] = {}  # (sequence type, length) -> plan

    def plan_for(self, data: Any) -> AppendPlan | None:
        """The cached plan of a flat dict/sequence laid out as before (None: take ``flatten``)."""
        if type(data) is dict:
            return self._dict_plans.get(tuple(data))
        if isinstance(data, (list, tuple)):
            return self._seq_plans.get((type(data), len(data)))
        return None

    def flatten(self, data: Any, steps: int, episode_id: int
                ) -> tuple[list[ColumnBuffer], list[Any], list[ColumnBuffer]]:
        """(columns with data, their converted values, columns without) of one appended step.

        New leaf paths become columns padded with ``steps`` empty steps.
        """
        pairs = nest.flatten_with_paths(data, none_is_leaf=True)
        if not pairs:
            raise ValueError("append needs at least one field")
        new_paths = [path for path, _ in pairs if path not in self.by_path]
        for path in new_paths:
            self._check_new_path(path)
        if new_paths:
            self._grow(data, new_paths, steps, episode_id)
        present = [(self.by_path[p], v) for p, v in pairs if v is not None]
        converted = [c.convert(v) for c, v in present]
        seen = {id(c) for c, _ in present}
        missing = [c for c in self.columns if id(c) not in seen]
        cols = [c for c, _ in present]
        self._maybe_cache_plan(data, cols, missing, len(pairs) == len(present))
        return cols, converted, missing

    def configure(self, path: tuple, num_keep_alive_refs: int, max_chunk_length: int | None) -> None:
        self.column_config[path] = (int(num_keep_alive_refs), max_chunk_length)
        column = self.by_path.get(path)
        if column is not None:
            self._apply_config(column)  # a new buffer, if any: chunk views keep the old one alive

    def history(self, steps: StepCount) -> Any:
        if self._history is None:
            self._history = self._build_history(self._skeleton, (), steps)
        return self._history

    def _apply_config(self, column: ColumnBuffer) -> None:
        config = self.column_config.get(column.path)
        if config is not None:
            column.set_keep(config[0])
            column.max_chunk_length = config[1]

    def _maybe_cache_plan(self, data: Any, columns: list[ColumnBuffer], missing: list[ColumnBuffer],
                          complete: bool) -> None:
        """Cache the layout of flat data (every field a leaf with data) for the fast path."""
        if not complete or any(c.dtype is None for c in columns):
            return
        t = type(data)
        if t is dict:
            if any(nest.is_nested(v) for v in data.values()) or len(self._dict_plans) > _MAX_PLANS:
                return
            keys = sorted(data)
            if len(keys) == 1:
                key = keys[0]

                def getter(d: dict) -> tuple:
                    return (d[key],)
            else:
                getter = operator.itemgetter(*keys)
            self._dict_plans[tuple(data)] = AppendPlan(columns, missing, getter)
        elif isinstance(data, (list, tuple)):
            if any(nest.is_nested(v) for v in data) or len(self._seq_plans) > _MAX_PLANS:
                return
            self._seq_plans[(t, len(data))] = AppendPlan(columns, missing, None)

    def _check_new_path(self, path: tuple) -> None:
        n = len(path)
        for other in self.by_path:
            m = len(other)
            if (m < n and path[:m] == other) or (n < m and other[:n] == path):
                raise ValueError(f"field {format_path(path)} conflicts with field {format_path(other)}: a leaf "
                                 f"cannot become a nest (or the reverse)")

    def _grow(self, data: Any, new_paths: list[tuple], steps: int, episode_id: int) -> None:
        for path in new_paths:
            column = ColumnBuffer(path, len(self.columns), self.keep, steps, episode_id)
            self.columns.append(column)
            self.by_path[path] = column
            self._apply_config(column)
        self._skeleton = _union(self._skeleton, data)
        self._history = None
        self._dict_plans.clear()
        self._seq_plans.clear()

    def _build_history(self, skeleton: Any, path: tuple, steps: StepCount) -> Any:
        if skeleton is _LEAF:
            return ColumnHistory(self.by_path[path], steps)
        if isinstance(skeleton, dict):
            return {k: self._build_history(v, path + (k,), steps) for k, v in skeleton.items()}
        if nest.is_namedtuple(skeleton):
            return type(skeleton)(*[self._build_history(v, path + (i,), steps) for i, v in enumerate(skeleton)])
        if isinstance(skeleton, (list, tuple)):
            return type(skeleton)(self._build_history(v, path + (i,), steps) for i, v in enumerate(skeleton))
        return None


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
