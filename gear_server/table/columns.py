"""A table's item bytes: the column layout, learned or regrown, and its segment.

The store lays the table's items out slot-major in one shared-memory segment
(``row_layout``): slot ``s`` is one row holding every column's steps (up to
``max_length`` per column), addressed through the ordinary ``TableLayout``
contract. The column specs (dtype, step shape, squeezed) come from the
signature and the first item, or are learned from the first item of a table
without a signature.

Memory follows the items: the file is sparse and a slot's row is allocated
(``reserve``) before it is first written, a step ahead; capacity starts small
and more slots lengthen the same file (layout version + 1, nothing copied, old
mappings stay valid). A longer item needs a new segment (layout version + 1)
into which the used slots are copied; the old one is released (learners still
mapping it keep their mapping until they follow the new layout version).

A store is not thread-safe: its table calls it under the table's lock and makes
sure no copy into a slot is in flight while the segment is replaced.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import ALIGNMENT, ColumnLayout, TableLayout, align_up
from gear_server.errors import ShmExhausted
from gear_server.storage import Segment, SegmentStore
from gear_server.table.items import ColumnSpec, PreparedItem, layout_mismatch, structure_mismatch

# A new segment maps about this much (at least MIN_INITIAL_SLOTS slots), then doubles as it fills.
INITIAL_SEGMENT_BYTES = 16 << 20
MIN_INITIAL_SLOTS = 64
# Memory is allocated ahead of the slots in use by about the bytes already in use, within these bounds.
MIN_RESERVE_STEP_BYTES = 1 << 20
RESERVE_STEP_BYTES = 32 << 20


def gather(views: list[np.ndarray], specs: list[ColumnSpec], slots: np.ndarray, lengths: np.ndarray
           ) -> list[np.ndarray]:
    """Per column, the slots' steps concatenated (one copy per column)."""
    out = []
    n = len(slots)
    for c, spec in enumerate(specs):
        view = views[c]
        if spec.squeeze:
            out.append(view[slots, 0])
            continue
        lens = lengths[:, c]
        first = int(lens[0]) if n else 0
        if n and np.all(lens == first):
            out.append(view[slots, :first].reshape(n * first, *spec.step_shape))
            continue
        buf = np.empty((int(lens.sum()), *spec.step_shape), spec.dtype)
        t = 0
        for s, ln in zip(slots.tolist(), lens.tolist(), strict=True):
            buf[t:t + ln] = view[s, :ln]
            t += ln
        out.append(buf)
    return out


def scatter(views: list[np.ndarray], specs: list[ColumnSpec], slots: np.ndarray, lengths: np.ndarray,
            columns: list[np.ndarray]) -> None:
    """The inverse of :func:`gather`: write per-column concatenated steps into ``slots``."""
    n = len(slots)
    for c, spec in enumerate(specs):
        data = columns[c]
        view = views[c]
        if spec.squeeze:
            view[slots, 0] = data
        elif n and np.all(lengths[:, c] == lengths[0, c]):
            ln = int(lengths[0, c])
            view[slots, :ln] = np.asarray(data).reshape(n, ln, *spec.step_shape)
        else:
            t = 0
            for slot, ln in zip(slots.tolist(), lengths[:, c].tolist(), strict=True):
                view[slot, :ln] = data[t:t + ln]
                t += ln


def slot_views(views: list[np.ndarray], specs: list[ColumnSpec], slots: np.ndarray, lengths: np.ndarray
               ) -> list[list[np.ndarray]]:
    """Per column, one no-copy view per slot of its ``lengths`` steps."""
    slot_list = slots.tolist()
    out = []
    for c, spec in enumerate(specs):
        view = views[c]
        if spec.squeeze:
            out.append([view[s, 0] for s in slot_list])
        else:
            out.append([view[s, :ln] for s, ln in zip(slot_list, lengths[:, c].tolist(), strict=True)])
    return out


def write_item(views: list[np.ndarray], slot: int, pieces: list[list[np.ndarray]]) -> None:
    """Copy one item's column pieces into ``slot`` (no lock needed: the slot is reserved for the writer)."""
    for c, parts in enumerate(pieces):
        view = views[c]
        t = 0
        for p in parts:
            n = p.shape[0]
            view[slot, t:t + n] = p
            t += n


def row_layout(table: str, path: str, capacity: int, specs: list[ColumnSpec], lengths: list[int], version: int,
               structure: pb.Structure) -> TableLayout:
    """A slot-major layout: slot ``s`` is one row of ``row_bytes`` holding every column's steps.

    Column ``c`` starts at ``offset_c`` inside the row (128-byte aligned) and its slot
    stride is the row size, so ``offset + slot * slot_stride`` addresses it as any
    ``ColumnLayout``. Slots beyond ``capacity`` are added by lengthening the file: the
    offsets and strides of existing slots do not move.
    """
    columns = []
    offset = 0
    for spec, length in zip(specs, lengths, strict=True):
        step = spec.dtype.itemsize * int(np.prod(spec.step_shape, dtype=np.int64))
        columns.append((spec, int(length), step, offset))
        offset = align_up(offset + max(step * int(length), 1))
    row = max(offset, ALIGNMENT)
    placed = tuple(ColumnLayout(spec.name, spec.dtype, tuple(int(d) for d in spec.step_shape), off, row, length,
                                spec.squeeze) for spec, length, _, off in columns)
    return TableLayout(table, path, int(capacity), placed, version, structure)


def structure_of(arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Any]) -> pb.Structure | None:
    """The items' structure a checkpoint records (``ColumnStore.snapshot``); None when it records none."""
    if not scalars.get("has_structure"):
        return None
    structure = pb.Structure()
    structure.ParseFromString(np.asarray(arrays["structure"], np.uint8).tobytes())
    return structure


def row_bytes(layout: TableLayout) -> int:
    return layout.columns[0].slot_stride if layout.columns else 0


class ColumnStore:
    """Column specs, the layout and the segment of one table (see module docstring)."""

    def __init__(self, table: str, store: SegmentStore, structure: pb.Structure | None):
        self.table = table
        self._store = store
        self.structure = structure  # what items must look like (signature or learned); None until known
        self.specs: list[ColumnSpec] | None = None
        self.layout: TableLayout | None = None
        self.segment: Segment | None = None
        self.views: list[np.ndarray] = []
        self.max_lengths: list[int] = []
        self.reserved_rows = 0  # slots [0, reserved_rows) have their memory allocated
        self.version = -1
        self.epoch = 0  # bumped whenever the specs are (re)fixed

    @property
    def learned(self) -> bool:
        return self.specs is not None

    def fits(self, prep: PreparedItem) -> bool:
        """Whether the item has the learned structure, dtypes, step shapes and squeezes."""
        return self.specs is None or (prep.specs == [s.key for s in self.specs] and prep.structure == self.structure)

    def structure_mismatch(self, prep: PreparedItem) -> str | None:
        """Why the item's structure is not the table's (None when it is, or none is known yet)."""
        return None if self.structure is None else structure_mismatch(prep, self.structure)

    def layout_mismatch(self, prep: PreparedItem) -> str | None:
        """Why the item's columns do not fit the learned ones (None when they do, or none are learned)."""
        return None if self.specs is None else layout_mismatch(prep, self.specs)

    def grown_lengths(self, lengths: list[int]) -> list[int] | None:
        """New per-column max lengths if an item of ``lengths`` does not fit, else None."""
        current = self.max_lengths
        if all(ln <= cur for ln, cur in zip(lengths, current, strict=True)):
            return None
        return [cur if ln <= cur else max(ln, 2 * cur) for ln, cur in zip(lengths, current, strict=True)]

    def learn(self, specs: list[ColumnSpec], lengths: list[int], structure: pb.Structure, capacity: int) -> None:
        """Fix (or relearn) the column specs and create their segment. The segment comes first: if it
        cannot be made (e.g. ENOSPC), the store keeps its old layout."""
        self.build_segment(capacity, lengths, copy_rows=0, specs=specs, structure=structure)
        self.specs = specs
        self.structure = structure
        self.epoch += 1

    def initial_capacity(self, specs: list[ColumnSpec], lengths: list[int], at_least: int, at_most: int) -> int:
        """Slots a new segment starts with: about ``INITIAL_SEGMENT_BYTES`` worth, within [at_least, at_most]."""
        probe = row_layout(self.table, "", 1, specs, lengths, 0, pb.Structure())
        fit = INITIAL_SEGMENT_BYTES // max(1, row_bytes(probe))
        return int(min(at_most, max(at_least, fit, MIN_INITIAL_SLOTS)))

    def build_segment(self, capacity: int, lengths: list[int], copy_rows: int,
                      specs: list[ColumnSpec] | None = None, structure: pb.Structure | None = None) -> None:
        """Create the next layout version's segment (``specs``/``structure``: the current ones unless
        given), copy the first ``copy_rows`` slots of the current one into it and switch to it.
        On failure nothing changes."""
        specs = self.specs if specs is None else specs
        structure = self.structure if structure is None else structure
        version = self.version + 1
        path = self._store.segment_path(self.table, version)
        layout = row_layout(self.table, path, capacity, specs, lengths, version, structure)
        segment = self._store.create(self.table, version, layout.segment_size)
        try:
            views = [layout.column_view(segment.buffer, c) for c in range(len(specs))]
            if copy_rows:
                self._reserve_rows(segment, layout, 0, copy_rows)
                for c, old_col in enumerate(self.layout.columns):
                    views[c][:copy_rows, : old_col.max_length] = self.views[c][:copy_rows]
        except BaseException:
            self._store.release(segment)
            raise
        old_segment = self.segment
        self.layout, self.segment, self.views = layout, segment, views
        self.max_lengths = [c.max_length for c in layout.columns]
        self.version = version
        self.reserved_rows = copy_rows
        if old_segment is not None:
            self._store.release(old_segment)

    def regrow(self, capacity: int, lengths: list[int] | None, rows_in_use: int) -> bool:
        """Move to a layout with at least ``capacity`` slots and ``lengths`` steps per slot, items kept.

        More slots of the same length lengthen the segment file in place (nothing is copied or
        committed); longer slots need a new segment, into which slots ``[0, rows_in_use)`` are
        copied. False (nothing done) when the current layout is already that large.
        """
        old_capacity = self.layout.capacity
        current = [c.max_length for c in self.layout.columns]
        lengths = current if lengths is None else [max(a, b) for a, b in zip(lengths, current, strict=True)]
        capacity = max(capacity, old_capacity)
        if lengths == current:
            if capacity == old_capacity:
                return False
            version = self.version + 1
            layout = TableLayout(self.table, self._store.segment_path(self.table, version), capacity,
                                 self.layout.columns, version, self.layout.structure)
            self._store.grow(self.segment, self.table, version, layout.segment_size)
            self.layout, self.version = layout, version
            self.views = [layout.column_view(self.segment.buffer, c) for c in range(len(layout.columns))]
            return True
        self.build_segment(capacity, lengths, copy_rows=min(rows_in_use, self.reserved_rows))
        return True

    def reserve(self, slot: int) -> None:
        """Make sure the memory of ``slot`` is allocated before a writer copies into it.

        Memory is allocated as slots are first used, in steps of up to ``RESERVE_STEP_BYTES``
        (about doubling while the table is small), so a table commits what it holds rather
        than ``max_size`` items up front. ShmExhausted when the shm directory is full.
        """
        if slot < self.reserved_rows:
            return
        row = row_bytes(self.layout)
        step_rows = max(1, min(max(self.reserved_rows * row, MIN_RESERVE_STEP_BYTES), RESERVE_STEP_BYTES) // row)
        target = min(self.layout.capacity, max(slot + 1, self.reserved_rows + step_rows))
        try:
            self._reserve_rows(self.segment, self.layout, self.reserved_rows, target)
        except ShmExhausted:
            if target == slot + 1:
                raise
            target = slot + 1  # no room for a step ahead: take only what this item needs
            self._reserve_rows(self.segment, self.layout, self.reserved_rows, target)
        self.reserved_rows = target

    def _reserve_rows(self, segment: Segment, layout: TableLayout, start: int, stop: int) -> None:
        row = row_bytes(layout)
        try:
            segment.reserve(start * row, (stop - start) * row)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise ShmExhausted(self.table, (stop - start) * row, self._store.shm_dir, e.strerror or str(e)) from e

    def allocated_bytes(self) -> int:
        """Memory the table's segment holds now (0 before the first item)."""
        return self.segment.allocated_bytes() if self.segment is not None else 0

    def read(self, slots: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        return gather(self.views, self.specs, slots, lengths)

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, slots: np.ndarray, lengths: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The bytes of the items in ``slots`` (``lengths``: their steps per column) as checkpoint arrays,
        and the layout as scalars (docs/CHECKPOINT_FORMAT.md).

        Arrays: column/<c> (the items' steps concatenated, as ``Table.read``; none before the layout is
        known) and structure (a serialised gear.v1.Structure, empty when none is known). Scalars:
        columns (name, dtype, step shape, squeeze and max_length per column) and has_structure.
        """
        arrays: dict[str, np.ndarray] = {}
        columns: list[dict[str, Any]] = []
        if self.specs is not None:
            for c, data in enumerate(self.read(slots, lengths)):
                arrays[f"column/{c}"] = data
            for spec, col in zip(self.specs, self.layout.columns, strict=True):
                columns.append({**spec.to_json(), "max_length": col.max_length})
        structure = self.structure.SerializeToString() if self.structure is not None else b""
        arrays["structure"] = np.frombuffer(structure, np.uint8).copy()
        return arrays, {"columns": columns, "has_structure": self.structure is not None}

    def restore(self, arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Any], slots: np.ndarray,
                lengths: np.ndarray, capacity: int) -> None:
        """Load what ``snapshot`` returned: the structure, a new segment of ``capacity`` slots in the
        snapshot's layout (when it has one), and the items' bytes into ``slots``."""
        structure = structure_of(arrays, scalars)
        if structure is not None:
            self.structure = structure
        specs = [ColumnSpec.from_json(c) for c in scalars["columns"]]
        if not specs:
            return
        self.learn(specs, [int(c["max_length"]) for c in scalars["columns"]], self.structure, capacity)
        if len(slots):
            self.reserve(int(slots.max()))
        scatter(self.views, self.specs, slots, lengths, [arrays[f"column/{c}"] for c in range(len(specs))])

    def close(self) -> None:
        """Release the segment (views already handed out keep their mapping alive)."""
        segment, self.segment, self.views = self.segment, None, []
        if segment is not None:
            self._store.release(segment)
