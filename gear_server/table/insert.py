"""A table's insert path: validate, wait on the rate limiter, reserve a slot, copy outside the lock, publish.

The item is validated completely before anything changes. Under the lock the
insert waits for the rate limiter, fits its item to the layout (learning,
relearning or growing it: ``layout_fitting``) and takes a free slot; the bytes
are copied without the lock (``copies_in_flight`` holds off growth, reset,
restore and close meanwhile) and the item is published under it. An existing
key is a priority update (Reverb); a failed insert gives its slot and its
rate-limiter reservation back.
"""

from __future__ import annotations

import time

from gear_server.errors import TableClosedError
from gear_server.table.columns import write_item
from gear_server.table.core import Abandoned, TableCore
from gear_server.table.fitting import Placement, can_relearn, learn_layout, next_capacity, placement, regrow
from gear_server.table.items import ItemToInsert, PreparedItem
from gear_server.table.rate_limiter import deadline_after
from gear_server.table.side_store import SideItem


def insert(st: TableCore, item: ItemToInsert, timeout: float | None = None, abandoned: Abandoned = None) -> None:
    """Insert (or, for an existing key, update the priority of) one item (``Table.insert``)."""
    deadline = deadline_after(timeout)
    prep = item.validated()
    with st.lock:
        st.check_open()
        where = placement(st, prep)
        if prep.key in st.slots.key_to_slot:
            st.existing_key(prep)
            return
        epoch = st.columns.epoch
        st.rate_limiter.await_insert(deadline, abandoned)
        try:
            while True:
                st.check_open()
                if epoch != st.columns.epoch:
                    epoch = st.columns.epoch
                    where = placement(st, prep)
                if prep.key in st.slots.key_to_slot:
                    st.existing_key(prep)
                    st.rate_limiter.insert_abandoned()
                    return
                if st.exclusive:
                    st.cond.wait()
                    continue
                if not st.columns.learned or where is Placement.RELEARN:
                    if where is Placement.RELEARN and not can_relearn(st):  # items or leases came
                        where = placement(st, prep)
                        continue
                    learn_layout(st, prep)
                    continue
                if where is Placement.COLUMNS:
                    grown = st.columns.grown_lengths(prep.lengths)
                    if grown is not None:
                        regrow(st, st.capacity, grown)
                        continue
                if not st.slots.free:
                    regrow(st, next_capacity(st), None)
                    continue
                break
            if where is Placement.COLUMNS:
                st.columns.reserve(st.slots.free[-1])  # its memory, before anyone writes there
            slot = st.slots.take()
            st.copies_in_flight += 1
            views = st.columns.views
        except BaseException:
            st.rate_limiter.insert_abandoned()
            raise
    committed = False
    try:
        side = None
        if where is Placement.SIDE:
            side = SideItem.of(prep)
        else:
            write_item(views, slot, prep.pieces)
        with st.lock:
            st.copy_done()
            committed = True
            publish(st, slot, prep, side)
    except BaseException:
        with st.lock:
            if not committed:
                st.copy_done()
                st.slots.give_back(slot)
                st.rate_limiter.insert_abandoned()
        raise


def publish(st: TableCore, slot: int, prep: PreparedItem, side: SideItem | None) -> None:
    """Publish a copied item (lock held); insert-when-full then removes one through the remover."""
    t0 = time.perf_counter()
    if st.closed:
        st.slots.give_back(slot)
        st.rate_limiter.insert_abandoned()
        raise TableClosedError(f"table '{st.name}' closed during the insert")
    if prep.key in st.slots.key_to_slot:  # another insert of this key won the race
        st.slots.give_back(slot)
        st.existing_key(prep)
        st.rate_limiter.insert_abandoned()
        return
    st.seq += 1
    seq = st.seq
    if side is None:
        st.side.drop(slot)
        st.slots.occupy(slot, prep, seq, prep.lengths)
    else:
        st.slots.occupy(slot, prep, seq, 0)  # its lengths are the side item's
        st.side.put(slot, side)
    st.sampler.insert(slot, prep.priority, seq)
    st.remover.insert(slot, prep.priority, seq)
    if len(st.slots) > st.max_size:
        victim = st.remover.pick_one(st.rng)
        st.delete_slot(victim)
    st.rate_limiter.insert_committed()
    st.worker_time_s += time.perf_counter() - t0
