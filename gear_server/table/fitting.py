"""Fitting items to a table's column layout: where an item goes, learning the layout, growing the segment.

A table with a signature fixes its layout from it; one without learns it from
the first item and relearns it (a new segment, layout version + 1) from an item
of another layout once it is empty and idle; until then such items go to the
side store. Longer items regrow the slots (items kept); more items than slots
grow the capacity. Every function here is called with the table's lock held (``_locked``).
"""

from __future__ import annotations

import enum

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.core import TableCore
from gear_server.table.items import ColumnSpec, PreparedItem, leaf_paths


class Placement(enum.Enum):
    """Where an item goes."""

    COLUMNS = "columns"  # the column slots of the learned (or signed) layout
    RELEARN = "relearn"  # the table is empty and idle: its layout is learned anew from this item
    SIDE = "side"  # another layout while the table holds items: the side store (no signature only)


def can_relearn_locked(core: TableCore) -> bool:
    """Whether a signature-less table may take a new layout now: it holds no item, lease or copy.

    The caller holds the lock.
    """
    return core.signature is None and core.columns.learned and core.slots.idle() and not core.copies_in_flight


def placement_locked(core: TableCore, prep: PreparedItem) -> Placement:
    """Where the item goes: the column slots, a relearned layout (the table is empty and idle), or the
    side store (a signature-less table holding items of another layout). With a signature the item
    must fit it (ValueError naming the leaf otherwise). The caller holds the lock."""
    if not core.columns.learned:
        check_fits_locked(core, prep)
        return Placement.COLUMNS
    if core.columns.fits(prep):
        check_fits_locked(core, prep)
        return Placement.COLUMNS
    if can_relearn_locked(core):
        return Placement.RELEARN
    if core.signature is None:
        return Placement.SIDE
    check_fits_locked(core, prep)
    return Placement.COLUMNS


def check_fits_locked(core: TableCore, prep: PreparedItem) -> None:
    """ValueError unless the item matches the signature and the learned layout. The caller holds the lock."""
    # a signature compares flattened leaves (Reverb); a learned layout the whole structure
    why = core.columns.structure_mismatch(prep) if core.signature is None else None
    if why is None and core.signature is not None:
        try:
            core.signature.check(prep)
        except ValueError as e:
            why = str(e)
    if why is None:
        why = core.columns.layout_mismatch(prep)
    if why is not None:
        raise ValueError(why)


def learn_layout_locked(core: TableCore, prep: PreparedItem) -> None:
    """Fix the column specs from the first item, or relearn them from an item that breaks the
    learned ones while the table holds nothing, and create the segment.

    A relearned layout gets a new segment (version + 1, the old one is released) and a new
    layout epoch, so waiting inserts re-validate and data-plane sessions fetch the new layout.
    The caller holds the lock (released while it waits for copies in flight).
    """
    core.begin_exclusive_locked()
    try:
        if core.columns.learned and not (can_relearn_locked(core) and not core.columns.fits(prep)):
            return  # learned meanwhile (and the item fits, or it is refused by the caller)
        sig = core.signature
        names = sig.names() if sig is not None else leaf_paths(prep.structure)
        specs = [ColumnSpec(names[c], dtype, tuple(shape), squeezed)
                 for c, (dtype, shape, squeezed) in enumerate(prep.specs)]
        lengths = []
        for c, s in enumerate(specs):
            if s.squeeze:
                lengths.append(1)
                continue
            fixed = sig.fixed_length(c, len(s.step_shape)) if sig is not None else -1
            if fixed >= 0:
                lengths.append(int(fixed))
            else:
                lengths.append(max(int(core.config.initial_max_length), prep.lengths[c], 1))
        structure = pb.Structure()
        structure.CopyFrom(sig.structure if sig is not None else prep.structure)
        capacity = core.columns.initial_capacity(specs, lengths, at_least=core.capacity,
                                                  at_most=core.max_size + core.spare)
        core.columns.learn(specs, lengths, structure, capacity)
        core.slots.set_num_columns(len(specs))
        core.grow_slots_locked(capacity)
    finally:
        core.end_exclusive_locked()


def next_capacity_locked(core: TableCore) -> int:
    """Slots after a growth: doubling up to max_size + spare, then spare more (leases pin deleted slots).

    The caller holds the lock.
    """
    full = core.max_size + core.spare
    if core.capacity < full:
        return min(full, 2 * core.capacity)
    return core.capacity + max(core.spare, 16)


def regrow_locked(core: TableCore, capacity: int, lengths: list[int] | None) -> None:
    """Move to a new segment with more slots and/or longer slots, items kept.

    The caller holds the lock (released while it waits for copies in flight).
    """
    core.begin_exclusive_locked()
    try:
        if not core.columns.regrow(capacity, lengths, core.slots.rows_in_use()):
            return
        core.grow_slots_locked(core.columns.layout.capacity)
    finally:
        core.end_exclusive_locked()
