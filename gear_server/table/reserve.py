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
from gear_server.table.fitting import next_capacity_locked, regrow_locked
from gear_server.table.insert import publish_locked
from gear_server.table.items import PreparedItem, ReservedItem, check_key
from gear_server.table.rate_limiter import deadline_after


class LayoutMoved(Exception):
    """A reserved item's rows were written into a segment the table has left (``layout``: the current one)."""

    def __init__(self, layout: TableLayout):
        super().__init__(f"the table moved to layout version {layout.version}")
        self.layout = layout


def reserve(core: TableCore, count: int) -> tuple[list[int], TableLayout | None]:
    """Up to ``count`` free slots for a writer (growing capacity if needed), and the layout they address;
    no slots and None while the table has no layout yet (its first item goes over InsertStream)."""
    if count < 1:
        raise ValueError(f"count of slots to reserve must be >= 1, got {count}")
    with core.lock:
        core.check_open_locked()
        while core.wait_for_exclusive_locked():
            core.check_open_locked()
        if not core.columns.learned:
            return [], None
        slots = []
        for _ in range(count):
            if not core.slots.free:
                regrow_locked(core, next_capacity_locked(core), None)
            core.columns.reserve(core.slots.free[-1])  # its memory, before the writer copies there
            slots.append(core.slots.reserve())
        return slots, core.columns.layout


def unreserve(core: TableCore, slots: Iterable[int]) -> None:
    """Give back reserved slots that will not be committed (unknown ones are ignored)."""
    with core.lock:
        for slot in slots:
            if core.slots.unreserve(int(slot)) and not core.closed:
                core.slots.give_back(int(slot))


def commit(core: TableCore, layout_version: int, item: ReservedItem, timeout: float | None = None,
           abandoned: Abandoned = None) -> None:
    """Insert an item whose rows a writer wrote into a reserved slot, as an insert would (see module doc)."""
    deadline = deadline_after(timeout)
    prep = PreparedItem(check_key(item.key), check_priority(item.priority, f"priority of item {item.key}"),
                        [], list(item.lengths), [], tuple(sorted(set(item.episode_ids))), None)
    with core.lock:
        core.check_open_locked()
        if item.slot not in core.slots.reserved:
            raise ValueError(f"slot {item.slot} of table '{core.name}' is not reserved")
        if core.columns.layout.version != layout_version:
            raise LayoutMoved(core.columns.layout)
        check_lengths_locked(core, item)
        if prep.key in core.slots.key_to_slot:
            core.existing_key_locked(prep)
            core.slots.unreserve(item.slot)
            core.slots.give_back(item.slot)
            return
        core.rate_limiter.await_insert(deadline, abandoned)
        admitted = False
        try:
            while core.wait_for_exclusive_locked():
                pass
            core.check_open_locked()
            if core.columns.layout.version != layout_version:
                raise LayoutMoved(core.columns.layout)
            if item.slot not in core.slots.reserved:  # given back while the rate limiter held it
                raise ValueError(f"slot {item.slot} of table '{core.name}' is no longer reserved")
            core.slots.unreserve(item.slot)
            admitted = True
        finally:
            if not admitted:
                core.rate_limiter.insert_abandoned()
        publish_locked(core, item.slot, prep, None)


def check_lengths_locked(core: TableCore, item: ReservedItem) -> None:
    """ValueError unless a reserved item's lengths fit its slot and the signature. The caller holds the lock."""
    columns = core.columns.layout.columns
    if len(item.lengths) != len(columns):
        raise ValueError(f"item {item.key}: {len(item.lengths)} column lengths for a table of {len(columns)} columns")
    for c, (length, col) in enumerate(zip(item.lengths, columns, strict=True)):
        low, high = (1, 1) if col.squeeze else (1, col.max_length)
        if not low <= length <= high:
            raise ValueError(f"item {item.key}: column '{col.name}' (#{c}) has length {length}, outside "
                             f"[{low}, {high}] of the slot")
        fixed = core.signature.fixed_length(c, len(col.shape)) if core.signature is not None and not col.squeeze else -1
        if fixed >= 0 and length != fixed:
            raise ValueError(f"item {item.key}: column '{col.name}' (#{c}) has {length} steps but the "
                             f"signature says {fixed}")
