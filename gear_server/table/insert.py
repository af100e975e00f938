"""A table's insert path: validate, wait on the rate limiter, reserve a slot, copy outside the lock, publish.

The item is validated completely before anything changes. Under the lock the
insert waits for the rate limiter, fits its item to the layout (learning,
relearning or growing it: ``fitting``) and takes a free slot; the bytes
are copied without the lock (a copy in flight holds off growth, reset,
restore and close meanwhile) and the item is published under it. An existing
key is a priority update (Reverb); a failed insert gives its slot and its
rate-limiter reservation back.
"""

from __future__ import annotations

import time

from gear_server.errors import TableClosedError
from gear_server.table.columns import write_item
from gear_server.table.core import Abandoned, TableCore
from gear_server.table.fitting import (
    Placement,
    can_relearn_locked,
    learn_layout_locked,
    next_capacity_locked,
    placement_locked,
    regrow_locked,
)
from gear_server.table.items import ItemToInsert, PreparedItem
from gear_server.table.rate_limiter import deadline_after
from gear_server.table.side_store import SideItem


def insert(core: TableCore, item: ItemToInsert, timeout: float | None = None, abandoned: Abandoned = None) -> None:
    """Insert (or, for an existing key, update the priority of) one item (``Table.insert``)."""
    deadline = deadline_after(timeout)
    prep = item.validated()
    with core.lock:
        core.check_open_locked()
        where = placement_locked(core, prep)
        if prep.key in core.slots.key_to_slot:
            core.existing_key_locked(prep)
            return
        epoch = core.columns.epoch
        core.rate_limiter.await_insert(deadline, abandoned)
        try:
            while True:
                core.check_open_locked()
                if epoch != core.columns.epoch:
                    epoch = core.columns.epoch
                    where = placement_locked(core, prep)
                if prep.key in core.slots.key_to_slot:
                    core.existing_key_locked(prep)
                    core.rate_limiter.insert_abandoned()
                    return
                if core.wait_for_exclusive_locked():
                    continue
                if not core.columns.learned or where is Placement.RELEARN:
                    if where is Placement.RELEARN and not can_relearn_locked(core):  # items or leases came
                        where = placement_locked(core, prep)
                        continue
                    learn_layout_locked(core, prep)
                    continue
                if where is Placement.COLUMNS:
                    grown = core.columns.grown_lengths(prep.lengths)
                    if grown is not None:
                        regrow_locked(core, core.capacity, grown)
                        continue
                if not core.slots.free:
                    regrow_locked(core, next_capacity_locked(core), None)
                    continue
                break
            if where is Placement.COLUMNS:
                core.columns.reserve(core.slots.free[-1])  # its memory, before anyone writes there
            slot = core.slots.take()
            core.copy_started_locked()
            views = core.columns.views
        except BaseException:
            core.rate_limiter.insert_abandoned()
            raise
    committed = False
    try:
        side = None
        if where is Placement.SIDE:
            side = SideItem.of(prep)
        else:
            write_item(views, slot, prep.pieces)
        with core.lock:
            core.copy_done_locked()
            committed = True
            publish_locked(core, slot, prep, side)
    except BaseException:
        with core.lock:
            if not committed:
                core.copy_done_locked()
                core.slots.give_back(slot)
                core.rate_limiter.insert_abandoned()
        raise


def publish_locked(core: TableCore, slot: int, prep: PreparedItem, side: SideItem | None) -> None:
    """Publish a copied item into ``slot``; insert-when-full then removes one through the remover.

    The caller holds the lock.
    """
    t0 = time.perf_counter()
    if core.closed:
        core.slots.give_back(slot)
        core.rate_limiter.insert_abandoned()
        raise TableClosedError(f"table '{core.name}' closed during the insert")
    if prep.key in core.slots.key_to_slot:  # another insert of this key won the race
        core.slots.give_back(slot)
        core.existing_key_locked(prep)
        core.rate_limiter.insert_abandoned()
        return
    seq = core.next_seq_locked()
    if side is None:
        core.side.drop(slot)
        core.slots.occupy(slot, prep, seq, prep.lengths)
        if core.mirror is not None:
            core.mirror.committed(slot, int(core.meta.generation[slot]))
    else:
        core.slots.occupy(slot, prep, seq, 0)  # its lengths are the side item's
        core.side.put(slot, side)
    core.sampler.insert(slot, prep.priority, seq)
    core.remover.insert(slot, prep.priority, seq)
    if len(core.slots) > core.max_size:
        victim = core.remover.pick_one(core.rng)
        core.delete_slot_locked(victim)
    core.rate_limiter.insert_committed()
    core.add_worker_time_locked(t0)
