"""A table's whole state as arrays and JSON scalars (checkpoints), and loading it back.

``capture`` turns a table's parts into a ``TableSnapshot``; ``RestorePlan``
checks a snapshot against the table it is loaded into before anything changes,
and ``RestorePlan.load`` puts the items back into their slots, so selection
(which walks slots) repeats exactly. The table calls both under its lock.
The on-disk format is docs/CHECKPOINT_FORMAT.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.columns import ColumnStore, scatter
from gear_server.table.items import ColumnSpec
from gear_server.table.selectors.base import Selector
from gear_server.table.side_store import SideItem, SideStore
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


def capture(slots: SlotBook, columns: ColumnStore, side: SideStore, selectors: dict[str, Selector],
            scalars: dict[str, Any]) -> TableSnapshot:
    """Items (insertion order), their bytes, slots, free-slot stack, episodes and selector state.

    Arrays: keys, priorities, insert_seq, update_seq, times_sampled, lengths [n, C],
    slots (where each item lives), free_slots (the free-slot stack), column/<c> (the
    items' steps concatenated, as ``Table.read``), episode_ids with episode_counts (per
    item), structure (serialised gear.v1.Structure), and sampler/<name>,
    remover/<name> (selector state, slots mapped to item indices). Items of other
    layouts (the side store) are marked in ``side`` (bool per item), left out of
    ``column/<c>``, and kept as ``side/<j>/structure`` and ``side/<j>/column/<c>`` with
    their specs and lengths in the scalar ``side_items``. ``scalars`` are the table's
    own (sequence numbers, rate limiter, rng...); the layout's are added.
    """
    m = slots.meta
    occupied = slots.occupied_in_insert_order()
    n = len(occupied)
    arrays: dict[str, np.ndarray] = {
        "keys": m.key[occupied], "priorities": m.priority[occupied], "insert_seq": m.insert_seq[occupied],
        "update_seq": m.update_seq[occupied], "times_sampled": m.times_sampled[occupied],
        "lengths": m.length[occupied], "slots": occupied.astype(np.int64),
        # leased slots of deleted items are free once restored (no lease survives)
        "free_slots": np.array(slots.free_stack(), np.int64),
    }
    side_mask = np.array([slot in side for slot in occupied.tolist()], np.bool_)
    primary = occupied[~side_mask]
    side_items: list[dict[str, Any]] = []
    if side_mask.any():
        arrays["side"] = side_mask
        for j, slot in enumerate(occupied[side_mask].tolist()):
            item = side.items[slot]
            arrays[f"side/{j}/structure"] = np.frombuffer(item.structure.SerializeToString(), np.uint8).copy()
            for c, data in enumerate(item.columns):
                arrays[f"side/{j}/column/{c}"] = data
            side_items.append({"lengths": list(item.lengths), "columns": [
                {"name": sp.name, "dtype": sp.dtype.str, "shape": list(sp.step_shape), "squeeze": sp.squeeze}
                for sp in item.specs]})
    column_info: list[dict[str, Any]] = []
    if columns.specs is not None:
        for c, data in enumerate(columns.read(primary, m.length[primary])):
            arrays[f"column/{c}"] = data
        for spec, col in zip(columns.specs, columns.layout.columns, strict=True):
            column_info.append({"name": spec.name, "dtype": spec.dtype.str, "shape": list(spec.step_shape),
                                "squeeze": spec.squeeze, "max_length": col.max_length})
    episodes = [slots.slot_episodes[s] for s in occupied.tolist()]
    arrays["episode_counts"] = np.array([len(e) for e in episodes], np.int64)
    arrays["episode_ids"] = np.array([e for ep in episodes for e in ep], np.uint64)
    structure = columns.structure.SerializeToString() if columns.structure is not None else b""
    arrays["structure"] = np.frombuffer(structure, np.uint8).copy()
    index = np.full(slots.capacity, -1, np.int64)
    index[occupied] = np.arange(n)
    for role, selector in selectors.items():
        for name, value in selector.snapshot().items():
            arrays[f"{role}/{name}"] = index[value]
    out = {"num_items": n, "capacity": slots.capacity, "columns": column_info,
           "has_structure": columns.structure is not None, "side_items": side_items}
    out.update(scalars)
    return TableSnapshot(arrays, out)


class RestorePlan:
    """A snapshot checked against the table it goes into (nothing in the table changes here)."""

    def __init__(self, snapshot: TableSnapshot, table: str, max_size: int, signature: pb.Structure | None):
        a, s = snapshot.arrays, snapshot.scalars
        self.arrays, self.scalars = a, s
        self.table = table
        n = int(s["num_items"])
        if n > max_size:
            raise ValueError(f"table '{table}': snapshot holds {n} items, more than max_size {max_size}")
        self.num_items = n
        self.specs = [ColumnSpec(c["name"], np.dtype(c["dtype"]), tuple(c["shape"]), bool(c["squeeze"]))
                      for c in s["columns"]]
        self.max_lengths = [int(c["max_length"]) for c in s["columns"]]
        self.structure: pb.Structure | None = None
        if s.get("has_structure"):
            self.structure = pb.Structure()
            self.structure.ParseFromString(np.asarray(a["structure"], np.uint8).tobytes())
        if n and not self.specs:
            raise ValueError(f"table '{table}': snapshot has items but no column layout")
        if signature is not None and self.structure is not None and self.structure != signature:
            raise ValueError(f"table '{table}': snapshot structure does not match the table's signature")
        self.lengths = np.asarray(a["lengths"], np.int32).reshape(n, len(self.specs))
        self.slots = np.asarray(a["slots"], np.int64) if "slots" in a else np.arange(n, dtype=np.int64)
        self.side = np.asarray(a["side"], np.bool_).reshape(n) if "side" in a else np.zeros(n, np.bool_)
        self.side_items = list(s.get("side_items", []))
        if len(self.side_items) != int(self.side.sum()):
            raise ValueError(f"table '{table}': snapshot marks {int(self.side.sum())} items of other layouts but "
                             f"describes {len(self.side_items)}")
        if self.side_items and signature is not None:
            raise ValueError(f"table '{table}': snapshot holds items of other layouts, the table has a signature")

    def capacity(self, at_least: int) -> int:
        """Slots the restored table needs: ``at_least``, the snapshot's capacity, every recorded slot."""
        n = self.num_items
        return max(at_least, int(self.scalars.get("capacity", 0)), int(self.slots.max()) + 1 if n else 0)

    def load(self, book: SlotBook, columns: ColumnStore, side: SideStore, selectors: dict[str, Selector]) -> None:
        """Put items, bytes, free stack, episodes and selector state into a fresh book and stores."""
        a, n, slots, lengths = self.arrays, self.num_items, self.slots, self.lengths
        if len(np.unique(slots)) != n:
            raise ValueError(f"table '{self.table}': snapshot has duplicate slots")
        primary = slots[~self.side]
        if self.specs:
            if len(primary):
                columns.reserve(int(primary.max()))
            scatter(columns.views, self.specs, primary, lengths[~self.side],
                    [a[f"column/{c}"] for c in range(len(self.specs))])
        for j, (slot, info) in enumerate(zip(slots[self.side].tolist(), self.side_items, strict=True)):
            structure = pb.Structure()
            structure.ParseFromString(np.asarray(a[f"side/{j}/structure"], np.uint8).tobytes())
            specs = [ColumnSpec(c["name"], np.dtype(c["dtype"]), tuple(c["shape"]), bool(c["squeeze"]))
                     for c in info["columns"]]
            data = [np.array(a[f"side/{j}/column/{c}"], dtype=spec.dtype, copy=True) for c, spec in enumerate(specs)]
            side.put(slot, SideItem(structure, specs, data, [int(x) for x in info["lengths"]]))
        m = book.meta
        m.key[slots] = a["keys"]
        m.priority[slots] = a["priorities"]
        m.insert_seq[slots] = a["insert_seq"]
        m.update_seq[slots] = a["update_seq"]
        m.times_sampled[slots] = a["times_sampled"]
        m.length[slots] = lengths
        m.valid[slots] = True
        m.generation[slots] = 1
        book.key_to_slot = dict(zip(m.key[slots].tolist(), slots.tolist(), strict=True))
        if len(book.key_to_slot) != n:
            raise ValueError(f"table '{self.table}': snapshot has duplicate keys")
        capacity = book.capacity
        used = np.zeros(capacity, np.bool_)
        used[slots] = True
        free = np.asarray(a["free_slots"], np.int64) if "free_slots" in a else np.zeros(0, np.int64)
        free = free[(free < capacity)]
        free = free[~used[free]]
        used[free] = True
        # slots the snapshot does not mention (a larger table) go below the recorded stack
        book.free = np.flatnonzero(~used)[::-1].tolist() + free.tolist()
        counts = np.asarray(a["episode_counts"], np.int64).tolist()
        ids = np.asarray(a["episode_ids"], np.uint64).tolist()
        t = 0
        for slot, cnt in zip(slots.tolist(), counts, strict=True):
            eps = tuple(ids[t:t + cnt])
            t += cnt
            book.slot_episodes[slot] = eps
            for e in eps:
                book.episode_refs[e] = book.episode_refs.get(e, 0) + 1
        book.num_deleted_episodes = int(self.scalars["num_deleted_episodes"])
        for role, selector in selectors.items():
            state = {k[len(role) + 1:]: slots[np.asarray(v, np.int64)] for k, v in a.items()
                     if k.startswith(role + "/")}
            selector.restore(slots, m.priority[slots], m.insert_seq[slots], m.update_seq[slots], state)
