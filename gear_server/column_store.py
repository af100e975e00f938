"""A table's item bytes: the column layout, learned or regrown, and its segment.

The store lays the table's columns out in one shared-memory segment
(``gear_contract.layout``): per column, ``capacity`` slots of up to
``max_length`` steps. The column specs (dtype, step shape, squeezed) come from
the signature and the first item, or are learned from the first item of a
table without a signature. When a longer item arrives, or more slots are
needed, the store moves to a new segment (layout version + 1) and copies the
items over; the old segment is released (learners still mapping it keep their
mapping until they follow the new layout version).

Every method runs under the table's lock; the table makes sure no copy into a
slot is in flight while the segment is replaced.
"""

from __future__ import annotations

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_server.items import ColumnSpec, PreparedItem, layout_mismatch, structure_mismatch
from gear_server.storage import Segment, SegmentStore


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
        self.build_segment(capacity, lengths, copy_from=None, specs=specs, structure=structure)
        self.specs = specs
        self.structure = structure
        self.epoch += 1

    def build_segment(self, capacity: int, lengths: list[int], copy_from: tuple | None,
                      specs: list[ColumnSpec] | None = None, structure: pb.Structure | None = None) -> None:
        """Create the next layout version's segment (``specs``/``structure``: the current ones unless
        given), copy ``copy_from``'s items into it and switch to it. On failure nothing changes."""
        specs = self.specs if specs is None else specs
        structure = self.structure if structure is None else structure
        version = self.version + 1
        columns = [(s.name, s.dtype, s.step_shape, lengths[c], s.squeeze) for c, s in enumerate(specs)]
        path = self._store.segment_path(self.table, version)
        layout = TableLayout.build(self.table, path, capacity, columns, version=version, structure=structure)
        segment = self._store.create(self.table, version, layout.segment_size)
        try:
            views = [layout.column_view(segment.buffer, c) for c in range(len(columns))]
            if copy_from is not None:
                old_layout, old_views, old_segment = copy_from
                for c, (old_col, new_col) in enumerate(zip(old_layout.columns, layout.columns, strict=True)):
                    if old_col.slot_stride == new_col.slot_stride:  # same slots, more of them: one memcpy
                        nbytes = old_col.slot_stride * old_layout.capacity
                        dst = np.frombuffer(segment.buffer, np.uint8, nbytes, new_col.offset)
                        dst[:] = np.frombuffer(old_segment.buffer, np.uint8, nbytes, old_col.offset)
                    else:
                        views[c][: old_layout.capacity, : old_col.max_length] = old_views[c]
        except BaseException:
            self._store.release(segment)
            raise
        old_segment = self.segment
        self.layout, self.segment, self.views = layout, segment, views
        self.max_lengths = [c.max_length for c in layout.columns]
        self.version = version
        if old_segment is not None:
            self._store.release(old_segment)

    def regrow(self, capacity: int, lengths: list[int] | None) -> bool:
        """Move to a segment with at least ``capacity`` slots and ``lengths`` steps per slot, items kept.

        False (nothing done) when the current segment is already that large.
        """
        old_capacity = self.layout.capacity
        current = [c.max_length for c in self.layout.columns]
        lengths = current if lengths is None else [max(a, b) for a, b in zip(lengths, current, strict=True)]
        if lengths == current and capacity <= old_capacity:
            return False
        old = (self.layout, self.views, self.segment)
        self.build_segment(max(capacity, old_capacity), lengths, copy_from=old)
        return True

    def read(self, slots: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        return gather(self.views, self.specs, slots, lengths)

    def close(self) -> None:
        """Release the segment (views already handed out keep their mapping alive)."""
        segment, self.segment, self.views = self.segment, None, []
        if segment is not None:
            self._store.release(segment)
