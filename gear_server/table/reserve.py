"""A table's reserved slots: the insert plane's side of the table (reserve, commit, give back).

A writer on the daemon's host takes free slots (``reserve``), writes its rows
into them in the shared-memory segment, and hands the items to ``commit``,
which goes through the insert path's rules: existing key = priority update
(a resend leaves it as it is), the rate limiter (blocking, or WouldBlock under
an event-loop WaitTicket), selectors, episodes, ``max_size`` eviction. Until
then a reserved slot is invisible: not valid, in no selector, out of the free
list, its generation bumped (as an insert bumps it), never under a lease.
``unreserve`` gives back slots that will not be committed.

A growth moves the table to a new segment (layout version + 1) keeping slot
numbers, so reservations survive it, but rows written into the old segment
after it was copied are not in the new one: a commit names the layout version
its rows were written into, and raises ``LayoutMoved`` (the item stays
reserved) when the table left it. A table does not relearn its layout while
slots are reserved (``SlotBook.idle``).
"""

from __future__ import annotations

from collections.abc import Iterable

from gear_contract.layout import TableLayout
from gear_contract.priorities import check_priority
from gear_server.table.core import Abandoned, TableCore
from gear_server.table.fitting import next_capacity, regrow
from gear_server.table.insert import publish
from gear_server.table.items import PreparedItem, ReservedItem, check_key
from gear_server.table.rate_limiter import deadline_after


class LayoutMoved(Exception):
    """A reserved item's rows were written into a segment the table has left (``layout``: the current one)."""

    def __init__(self, layout: TableLayout):
        super().__init__(f"the table moved to layout version {layout.version}")
        self.layout = layout


def reserve(st: TableCore, count: int) -> tuple[list[int], TableLayout | None]:
    """Up to ``count`` free slots for a writer (growing capacity if needed), and the layout they address;
    no slots and None while the table has no layout yet (its first item goes over InsertStream)."""
    if count < 1:
        raise ValueError(f"count of slots to reserve must be >= 1, got {count}")
    with st.lock:
        st.check_open()
        while st.exclusive:
            st.cond.wait()
            st.check_open()
        if not st.columns.learned:
            return [], None
        slots = []
        for _ in range(count):
            if not st.slots.free:
                regrow(st, next_capacity(st), None)
            st.columns.reserve(st.slots.free[-1])  # its memory, before the writer copies there
            slots.append(st.slots.reserve())
        return slots, st.columns.layout


def unreserve(st: TableCore, slots: Iterable[int]) -> None:
    """Give back reserved slots that will not be committed (unknown ones are ignored)."""
    with st.lock:
        for slot in slots:
            if st.slots.unreserve(int(slot)) and not st.closed:
                st.slots.give_back(int(slot))


def commit(st: TableCore, layout_version: int, item: ReservedItem, timeout: float | None = None,
           abandoned: Abandoned = None) -> None:
    """Insert an item whose rows a writer wrote into a reserved slot, as an insert would (see module doc)."""
    deadline = deadline_after(timeout)
    prep = PreparedItem(check_key(item.key), check_priority(item.priority, f"priority of item {item.key}"),
                        [], list(item.lengths), [], tuple(sorted(set(item.episode_ids))), None)
    with st.lock:
        st.check_open()
        if item.slot not in st.slots.reserved:
            raise ValueError(f"slot {item.slot} of table '{st.name}' is not reserved")
        if st.columns.layout.version != layout_version:
            raise LayoutMoved(st.columns.layout)
        check_lengths(st, item)
        if prep.key in st.slots.key_to_slot:
            st.existing_key(prep)
            st.slots.unreserve(item.slot)
            st.slots.give_back(item.slot)
            return
        st.rate_limiter.await_insert(deadline, abandoned)
        admitted = False
        try:
            while st.exclusive:
                st.cond.wait()
            st.check_open()
            if st.columns.layout.version != layout_version:
                raise LayoutMoved(st.columns.layout)
            if item.slot not in st.slots.reserved:  # given back while the rate limiter held it
                raise ValueError(f"slot {item.slot} of table '{st.name}' is no longer reserved")
            st.slots.unreserve(item.slot)
            admitted = True
        finally:
            if not admitted:
                st.rate_limiter.insert_abandoned()
        publish(st, item.slot, prep, None)


def check_lengths(st: TableCore, item: ReservedItem) -> None:
    """ValueError unless a reserved item's lengths fit its slot and the signature (lock held)."""
    columns = st.columns.layout.columns
    if len(item.lengths) != len(columns):
        raise ValueError(f"item {item.key}: {len(item.lengths)} column lengths for a table of {len(columns)} columns")
    for c, (length, col) in enumerate(zip(item.lengths, columns, strict=True)):
        low, high = (1, 1) if col.squeeze else (1, col.max_length)
        if not low <= length <= high:
            raise ValueError(f"item {item.key}: column '{col.name}' (#{c}) has length {length}, outside "
                             f"[{low}, {high}] of the slot")
        fixed = st.signature.fixed_length(c, len(col.shape)) if st.signature is not None and not col.squeeze else -1
        if fixed >= 0 and length != fixed:
            raise ValueError(f"item {item.key}: column '{col.name}' (#{c}) has {length} steps but the "
                             f"signature says {fixed}")
