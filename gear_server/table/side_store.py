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

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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
    """Side items by slot (not thread-safe: its table calls it under the table's lock)."""

    def __init__(self) -> None:
        self._items: dict[int, SideItem] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, slot: int) -> bool:
        return slot in self._items

    def put(self, slot: int, item: SideItem) -> None:
        self.drop(slot)
        self._items[slot] = item
        self.nbytes += item.nbytes

    def drop(self, slot: int) -> None:
        """Forget a slot's item (readers that hold its arrays keep them)."""
        item = self._items.pop(slot, None)
        if item is not None:
            self.nbytes -= item.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

    def keep_only(self, slots: Collection[int]) -> None:
        """Forget every item but those in ``slots``."""
        for slot in [s for s in self._items if s not in slots]:
            self.drop(slot)

    def layouts(self) -> int:
        """How many distinct layouts the side items have."""
        return len({item.layout_key for item in self._items.values()})

    def items_among(self, slots: Iterable[int]) -> dict[int, SideItem]:
        """The side items among ``slots``, by slot."""
        items = self._items
        return {s: items[s] for s in slots if s in items}

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, slots: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The side items among ``slots`` (a table's items in insertion order) as checkpoint arrays and
        scalars (docs/CHECKPOINT_FORMAT.md); nothing when there are none.

        Arrays: side (bool per item of ``slots``), and per side item j side/<j>/structure and
        side/<j>/column/<c>. Scalars: side_items (per side item its column specs and lengths).
        """
        mask = np.array([slot in self._items for slot in slots.tolist()], np.bool_)
        arrays: dict[str, np.ndarray] = {}
        side_items: list[dict[str, Any]] = []
        if mask.any():
            arrays["side"] = mask
            for j, slot in enumerate(slots[mask].tolist()):
                item = self._items[slot]
                arrays[f"side/{j}/structure"] = np.frombuffer(item.structure.SerializeToString(), np.uint8).copy()
                for c, data in enumerate(item.columns):
                    arrays[f"side/{j}/column/{c}"] = data
                side_items.append({"lengths": list(item.lengths), "columns": [sp.to_json() for sp in item.specs]})
        return arrays, {"side_items": side_items}

    def restore(self, arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Any], slots: np.ndarray) -> None:
        """Load what ``snapshot`` returned for ``slots`` (the same items, in the same order)."""
        if "side" not in arrays:
            return
        mask = np.asarray(arrays["side"], np.bool_).reshape(len(slots))
        for j, (slot, info) in enumerate(zip(slots[mask].tolist(), scalars["side_items"], strict=True)):
            structure = pb.Structure()
            structure.ParseFromString(np.asarray(arrays[f"side/{j}/structure"], np.uint8).tobytes())
            specs = [ColumnSpec.from_json(c) for c in info["columns"]]
            data = [np.array(arrays[f"side/{j}/column/{c}"], dtype=spec.dtype, copy=True)
                    for c, spec in enumerate(specs)]
            self.put(slot, SideItem(structure, specs, data, [int(x) for x in info["lengths"]]))
