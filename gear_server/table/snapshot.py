"""A table's whole state as arrays and JSON scalars (checkpoints), and loading it back.

``capture`` composes the snapshots of a table's parts (slot book, column store,
side store, selectors) into one ``TableSnapshot``; ``RestorePlan`` checks a
snapshot against the table it is loaded into before anything changes, and
``RestorePlan.load`` has each part restore its own, putting the items back
into their slots, so selection (which walks slots) repeats exactly. The table
calls both under its lock. The on-disk format is docs/CHECKPOINT_FORMAT.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.columns import ColumnStore, structure_of
from gear_server.table.items import ColumnSpec
from gear_server.table.selectors.base import Selector
from gear_server.table.side_store import SideStore
from gear_server.table.slots import SlotBook


@dataclass
class TableSnapshot:
    """Every piece of a table's state: arrays plus JSON-serialisable scalars."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


def jsonable(value: Any) -> Any:
    """numpy scalars inside nested dicts/lists -> Python scalars (for JSON)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def capture(slots: SlotBook, columns: ColumnStore, side: SideStore, selectors: Mapping[str, Selector],
            scalars: Mapping[str, Any]) -> TableSnapshot:
    """A table's parts as one snapshot: items (insertion order), their bytes, slots, free-slot stack,
    episodes, side items and selector state (docs/CHECKPOINT_FORMAT.md).

    Each part gives its own arrays and scalars (``SlotBook.snapshot``, ``SideStore.snapshot``,
    ``ColumnStore.snapshot``, ``Selector.snapshot``); the column store holds the items of the column
    layout, the side store the others. Selector state maps slots to item indices as
    ``<role>/<name>``. ``scalars`` are the table's own (sequence numbers, rate limiter, rng...).
    """
    arrays, out = slots.snapshot()
    occupied, lengths = arrays["slots"], arrays["lengths"]
    side_arrays, side_scalars = side.snapshot(occupied)
    primary = ~side_arrays["side"] if "side" in side_arrays else np.ones(len(occupied), np.bool_)
    column_arrays, column_scalars = columns.snapshot(occupied[primary], lengths[primary])
    arrays.update(side_arrays)
    arrays.update(column_arrays)
    index = np.full(slots.capacity, -1, np.int64)
    index[occupied] = np.arange(len(occupied))
    for role, selector in selectors.items():
        for name, value in selector.snapshot().items():
            arrays[f"{role}/{name}"] = index[value]
    out.update(column_scalars)
    out.update(side_scalars)
    out.update(scalars)
    return TableSnapshot(arrays, out)


class RestorePlan:
    """A snapshot checked against the table it goes into (nothing in the table changes here), in the
    current format: older snapshots without ``slots`` or ``free_slots`` get the slots they implied."""

    def __init__(self, snapshot: TableSnapshot, table: str, max_size: int, signature: pb.Structure | None):
        a, s = snapshot.arrays, snapshot.scalars
        self.scalars = s
        self.table = table
        n = int(s["num_items"])
        if n > max_size:
            raise ValueError(f"table '{table}': snapshot holds {n} items, more than max_size {max_size}")
        self.num_items = n
        self.specs = [ColumnSpec.from_json(c) for c in s["columns"]]
        structure = structure_of(a, s)
        if n and not self.specs:
            raise ValueError(f"table '{table}': snapshot has items but no column layout")
        if signature is not None and structure is not None and structure != signature:
            raise ValueError(f"table '{table}': snapshot structure does not match the table's signature")
        self.slots = np.asarray(a["slots"], np.int64) if "slots" in a else np.arange(n, dtype=np.int64)
        if len(np.unique(self.slots)) != n:
            raise ValueError(f"table '{table}': snapshot has duplicate slots")
        if len(np.unique(np.asarray(a["keys"]))) != n:
            raise ValueError(f"table '{table}': snapshot has duplicate keys")
        self.lengths = np.asarray(a["lengths"], np.int32).reshape(n, len(self.specs))
        self.side = np.asarray(a["side"], np.bool_).reshape(n) if "side" in a else np.zeros(n, np.bool_)
        side_items = list(s.get("side_items", []))
        if len(side_items) != int(self.side.sum()):
            raise ValueError(f"table '{table}': snapshot marks {int(self.side.sum())} items of other layouts but "
                             f"describes {len(side_items)}")
        if side_items and signature is not None:
            raise ValueError(f"table '{table}': snapshot holds items of other layouts, the table has a signature")
        self.arrays = {**a, "slots": self.slots, "lengths": self.lengths,
                       "free_slots": np.asarray(a["free_slots"], np.int64) if "free_slots" in a
                       else np.zeros(0, np.int64)}
        self.part_scalars = {**s, "side_items": side_items}

    def capacity(self, at_least: int) -> int:
        """Slots the restored table needs: ``at_least``, the snapshot's capacity, every recorded slot."""
        n = self.num_items
        return max(at_least, int(self.scalars.get("capacity", 0)), int(self.slots.max()) + 1 if n else 0)

    def load(self, book: SlotBook, columns: ColumnStore, side: SideStore, selectors: Mapping[str, Selector]) -> None:
        """Put the items, their bytes, free stack, episodes and selector state into a new book and side
        store, and the table's column store (``restore`` of each part)."""
        a, s, slots = self.arrays, self.part_scalars, self.slots
        primary = ~self.side
        columns.restore(a, s, slots[primary], self.lengths[primary], book.capacity)
        side.restore(a, s, slots)
        book.restore(a, s)
        m = book.meta
        for role, selector in selectors.items():
            state = {k[len(role) + 1:]: slots[np.asarray(v, np.int64)] for k, v in a.items()
                     if k.startswith(role + "/")}
            selector.restore(slots, m.priority[slots], m.insert_seq[slots], m.update_seq[slots], state)
