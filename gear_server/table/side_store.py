"""Items of a table without a signature whose structure is not the table's column layout.

A signature-less table keeps its items in fixed column slots laid out for one
structure (the first item's: the common case, read by reference over shm and
RDMA). Reverb's tables take items of any structure, so an item of another
structure, dtype or step shape is kept here instead: its own arrays in the
daemon's memory, under the slot number the table gave it (selection, leases,
rate limiting and every Reverb semantic stay the table's). Such items travel
over the inline plane only; a learner reading by reference is sent there while
the table holds any (gear_server/data_planes/manager.py).

Cost (bench/bench_table.py, ``side``): one copy per insert into a fresh array,
per-item Python bookkeeping, and inline transfer for the items of other structures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.items import ColumnSpec, PreparedItem, leaf_paths


@dataclass
class SideItem:
    """One item's columns: ``columns[c]`` is ``[lengths[c], *step]`` (a squeezed column: ``[1, *step]``)."""

    structure: pb.Structure
    specs: list[ColumnSpec]
    columns: list[np.ndarray]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.columns)

    @property
    def layout_key(self) -> tuple:
        """Items with equal keys can share one sample message (same structure and column specs)."""
        return (self.structure.SerializeToString(deterministic=True), tuple(s.key for s in self.specs))

    @classmethod
    def of(cls, prep: PreparedItem) -> SideItem:
        """Copy an item's pieces into arrays of its own (no lock needed)."""
        names = leaf_paths(prep.structure)
        specs = [ColumnSpec(names[c], dtype, tuple(shape), squeezed)
                 for c, (dtype, shape, squeezed) in enumerate(prep.specs)]
        columns = [np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], copy=True)
                   for parts in prep.pieces]
        structure = pb.Structure()
        structure.CopyFrom(prep.structure)
        return cls(structure, specs, columns, list(prep.lengths))


class SideStore:
    """Side items by slot (the table's lock held by the caller)."""

    def __init__(self) -> None:
        self.items: dict[int, SideItem] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, slot: int) -> bool:
        return slot in self.items

    def put(self, slot: int, item: SideItem) -> None:
        self.drop(slot)
        self.items[slot] = item
        self.nbytes += item.nbytes

    def drop(self, slot: int) -> None:
        """Forget a slot's item (readers that hold its arrays keep them)."""
        item = self.items.pop(slot, None)
        if item is not None:
            self.nbytes -= item.nbytes

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0
