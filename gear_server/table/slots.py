"""Which slot holds which item: per-slot metadata arrays, free slots, leases, reservations, episodes.

A table's items live in numbered slots (the same numbers index the segment's
columns and the selectors). ``SlotBook`` keeps the bookkeeping around them: the
metadata arrays the selection kernels read, the stack of free slots, the map
from key to slot, the leases readers hold, and which episodes each item
references. A deleted item's slot is not reused while a lease holds it (a
"zombie" until its last lease ends). Slots reserved by insert-plane writers
(filled in shared memory, then committed) are neither free nor valid until
their commit. A book is not thread-safe: its table calls it under the table's lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from gear_server.table.items import PreparedItem


class SlotCounts(NamedTuple):
    """How a table's slots are used (``SlotBook.counts``): each slot is in one of these, but for the slots
    inserts are copying into (taken, not yet holding their item)."""

    free: int  # a new item may take it
    items: int  # holds an item
    leased_deleted: int  # its item was deleted while a lease held it: free once the last lease ends
    reserved: int  # taken by an insert-plane writer, not committed yet


class Held(NamedTuple):
    """The slots a lease holds: one count of each slot in ``slots`` (a slot there twice counts once),
    plus ``extra[i]`` counts of ``extra_slots[i]`` (the repeats of a slot picked more than once)."""

    slots: np.ndarray
    extra_slots: np.ndarray
    extra: np.ndarray


# What a sample reads and writes of each picked slot, side by side in one 32-byte record: a batch of
# picks then fetches one cache line per pick instead of one per field (5x fewer lines from memory).
HOT = np.dtype([("key", "<u8"), ("priority", "<f8"), ("generation", "<u8"), ("times_sampled", "<i4"),
                ("leases", "<i4")])
# times_sampled and leases side by side read as one little-endian int64 (times_sampled its low half, never
# negative, so adding to one half never carries into the other): a pick counts both in one write per slot.
ONE_SAMPLE = np.int64(1)
ONE_LEASE = np.int64(1 << 32)


_COUNTS = np.dtype("<i8")
_COUNTS_OFFSET = HOT.fields["times_sampled"][1]
assert HOT.fields["leases"][1] == _COUNTS_OFFSET + 4  # the pair's high half


def sample_counts(records: np.ndarray) -> np.ndarray:
    """The (times_sampled, leases) pair of each of ``records`` (a 1-D HOT array) as one int64 view."""
    return np.ndarray(records.shape, _COUNTS, records, _COUNTS_OFFSET, records.strides)


class ItemMetadata:
    """Per-slot metadata arrays, indexed by slot.

    ``key``, ``priority``, ``generation``, ``times_sampled`` and ``leases`` are views of the fields
    of ``hot`` (one record per slot), so they are strided: index them (``a[slots]``), and gather a
    batch of slots' records with ``hot.take(slots)``, not ``a.take`` (which would copy the field
    whole first). ``counts`` views times_sampled and leases together (``sample_counts``).
    """

    FIELDS = ("insert_seq", "update_seq", "length", "valid")  # besides the records of ``hot``

    def __init__(self, capacity: int, num_columns: int):
        self.hot = np.zeros(capacity, HOT)
        self.key = self.hot["key"]
        self.priority = self.hot["priority"]
        self.generation = self.hot["generation"]
        self.times_sampled = self.hot["times_sampled"]
        self.leases = self.hot["leases"]
        self.counts = sample_counts(self.hot)
        self.insert_seq = np.zeros(capacity, np.int64)
        self.update_seq = np.zeros(capacity, np.int64)
        self.length = np.zeros((capacity, num_columns), np.int32)
        self.valid = np.zeros(capacity, np.bool_)

    @property
    def capacity(self) -> int:
        return len(self.key)

    def resized(self, capacity: int) -> ItemMetadata:
        """A copy with room for ``capacity`` slots (new slots zeroed)."""
        out = ItemMetadata(capacity, self.length.shape[1])
        n = min(capacity, self.capacity)
        out.hot[:n] = self.hot[:n]
        for name in self.FIELDS:
            getattr(out, name)[:n] = getattr(self, name)[:n]
        return out

    def with_columns(self, num_columns: int) -> ItemMetadata:
        """Empty metadata for ``num_columns`` columns that keeps the generations ((slot, generation) stays unique)."""
        out = ItemMetadata(self.capacity, num_columns)
        out.generation[:] = self.generation
        return out


class SlotBook:
    """Slots, keys, leases and episode references of one table (not thread-safe: see the module docstring)."""

    def __init__(self, capacity: int, num_columns: int):
        self.meta = ItemMetadata(capacity, num_columns)
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # a stack; slot 0 first
        self.zombies: set[int] = set()  # deleted but leased: reused once their leases end
        self.slot_episodes: list[tuple[int, ...]] = [()] * capacity
        self.key_to_slot: dict[int, int] = {}
        self.episode_refs: dict[int, int] = {}
        self.num_deleted_episodes = 0
        self.leases: dict[int, Held] = {}
        self.reserved: set[int] = set()  # taken by insert-plane writers, not committed yet
        self._lease_ids = itertools.count(1)

    @property
    def capacity(self) -> int:
        return self.meta.capacity

    def __len__(self) -> int:
        return len(self.key_to_slot)

    def idle(self) -> bool:
        """No item, lease, leased deleted slot or reservation: the table's storage may be rebuilt from scratch."""
        return not self.key_to_slot and not self.leases and not self.zombies and not self.reserved

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots; the new ones are free (taken after the current free ones)."""
        old = self.capacity
        if capacity <= old:
            return
        self.meta = self.meta.resized(capacity)
        self.slot_episodes.extend([()] * (capacity - old))
        self.free[:0] = range(capacity - 1, old - 1, -1)

    def set_num_columns(self, num_columns: int) -> None:
        if self.meta.length.shape[1] != num_columns:
            self.meta = self.meta.with_columns(num_columns)

    # ------------------------------------------------------------------ items
    def take(self) -> int:
        """A free slot for a new item (its generation bumped: references to its old content go stale)."""
        slot = self.free.pop()
        self.meta.generation[slot] += np.uint64(1)
        return slot

    def give_back(self, slot: int) -> None:
        """Return a slot taken for an insert that did not happen."""
        self.free.append(slot)

    def reserve(self) -> int:
        """A free slot for an insert-plane writer to fill (``take``, remembered as reserved)."""
        slot = self.take()
        self.reserved.add(slot)
        return slot

    def unreserve(self, slot: int) -> bool:
        """Forget a reservation (committed, or given back by the caller); False if it was not reserved."""
        if slot not in self.reserved:
            return False
        self.reserved.discard(slot)
        return True

    def occupy(self, slot: int, prep: PreparedItem, seq: int, lengths: list[int] | int) -> None:
        """Record ``prep`` as the item in ``slot``, with ``lengths`` per column in ``meta.length``."""
        m = self.meta
        m.key[slot] = prep.key
        m.priority[slot] = prep.priority
        m.insert_seq[slot] = seq
        m.update_seq[slot] = seq
        m.times_sampled[slot] = 0
        m.length[slot] = lengths
        m.valid[slot] = True
        self.key_to_slot[prep.key] = slot
        self.slot_episodes[slot] = prep.episode_ids
        for e in prep.episode_ids:
            self.episode_refs[e] = self.episode_refs.get(e, 0) + 1

    def set_priorities(self, slots: int | np.ndarray, priorities: float | np.ndarray,
                       seqs: int | np.ndarray) -> None:
        """Record priority updates: ``slots`` (items) get ``priorities``, updated at sequence numbers ``seqs``."""
        self.meta.priority[slots] = priorities
        self.meta.update_seq[slots] = seqs

    def vacate(self, slot: int) -> None:
        """Remove the item in ``slot``; the slot is free once no lease holds it."""
        m = self.meta
        key = int(m.key[slot])
        m.valid[slot] = False
        del self.key_to_slot[key]
        for e in self.slot_episodes[slot]:
            refs = self.episode_refs[e] - 1
            if refs:
                self.episode_refs[e] = refs
            else:
                del self.episode_refs[e]
                self.num_deleted_episodes += 1
        self.slot_episodes[slot] = ()
        if m.leases[slot] > 0:
            self.zombies.add(slot)
        else:
            self.free.append(slot)

    def clear(self) -> None:
        """Remove every item (leased slots stay zombies until released)."""
        m = self.meta
        slots = np.flatnonzero(m.valid)
        m.valid[slots] = False
        leased = m.leases[slots] > 0
        self.zombies.update(slots[leased].tolist())
        self.free.extend(slots[~leased].tolist())
        self.key_to_slot.clear()
        for s in slots.tolist():
            self.slot_episodes[s] = ()
        self.episode_refs.clear()
        self.num_deleted_episodes = 0

    def occupied_in_insert_order(self) -> np.ndarray:
        """Slots holding items, oldest insert first."""
        m = self.meta
        slots = np.flatnonzero(m.valid)
        return slots[np.argsort(m.insert_seq[slots], kind="stable")]

    def rows_in_use(self) -> int:
        """One past the highest slot whose bytes matter (an item, a lease on a deleted one, a reservation)."""
        used = np.flatnonzero(self.meta.valid | (self.meta.leases > 0))
        last = int(used[-1]) + 1 if len(used) else 0
        return max(last, max(self.reserved) + 1) if self.reserved else last  # writers fill reserved ones

    def free_stack(self) -> list[int]:
        """Every slot a new item may take, bottom of the stack first (leased deleted slots below the rest)."""
        return sorted(self.zombies) + self.free

    def counts(self) -> SlotCounts:
        """How many slots are free, hold an item, are leased after a delete, or are reserved."""
        return SlotCounts(len(self.free), len(self.key_to_slot), len(self.zombies), len(self.reserved))

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The items, oldest insert first, as checkpoint arrays and scalars (docs/CHECKPOINT_FORMAT.md).

        Arrays: keys, priorities, insert_seq, update_seq, times_sampled, lengths [n, C], slots (where
        each item lives), free_slots (the free-slot stack; leased slots of deleted items are free once
        restored, as no lease survives), episode_counts and episode_ids (per item). Scalars:
        num_items, capacity, num_deleted_episodes.
        """
        m = self.meta
        occupied = self.occupied_in_insert_order()
        episodes = [self.slot_episodes[s] for s in occupied.tolist()]
        arrays = {
            "keys": m.key[occupied], "priorities": m.priority[occupied], "insert_seq": m.insert_seq[occupied],
            "update_seq": m.update_seq[occupied], "times_sampled": m.times_sampled[occupied],
            "lengths": m.length[occupied], "slots": occupied.astype(np.int64),
            "free_slots": np.array(self.free_stack(), np.int64),
            "episode_counts": np.array([len(e) for e in episodes], np.int64),
            "episode_ids": np.array([e for ep in episodes for e in ep], np.uint64),
        }
        scalars = {"num_items": len(occupied), "capacity": self.capacity,
                   "num_deleted_episodes": self.num_deleted_episodes}
        return arrays, scalars

    def restore(self, arrays: Mapping[str, np.ndarray], scalars: Mapping[str, Any]) -> None:
        """Load what ``snapshot`` returned into this new book (its capacity holds every recorded slot;
        slots and keys are distinct, as ``RestorePlan`` checks). Slots the snapshot does not mention
        (a larger book) are free, below the recorded free-slot stack."""
        if self.key_to_slot or self.leases or self.reserved:
            raise ValueError("a slot book restores into a new book only")
        slots = np.asarray(arrays["slots"], np.int64)
        m = self.meta
        m.key[slots] = arrays["keys"]
        m.priority[slots] = arrays["priorities"]
        m.insert_seq[slots] = arrays["insert_seq"]
        m.update_seq[slots] = arrays["update_seq"]
        m.times_sampled[slots] = arrays["times_sampled"]
        m.length[slots] = arrays["lengths"]
        m.valid[slots] = True
        m.generation[slots] = 1
        self.key_to_slot = dict(zip(m.key[slots].tolist(), slots.tolist(), strict=True))
        used = np.zeros(self.capacity, np.bool_)
        used[slots] = True
        free = np.asarray(arrays["free_slots"], np.int64)
        free = free[free < self.capacity]
        free = free[~used[free]]
        used[free] = True
        self.free = np.flatnonzero(~used)[::-1].tolist() + free.tolist()
        counts = np.asarray(arrays["episode_counts"], np.int64).tolist()
        ids = np.asarray(arrays["episode_ids"], np.uint64).tolist()
        t = 0
        for slot, cnt in zip(slots.tolist(), counts, strict=True):
            eps = tuple(ids[t:t + cnt])
            t += cnt
            self.slot_episodes[slot] = eps
            for e in eps:
                self.episode_refs[e] = self.episode_refs.get(e, 0) + 1
        self.num_deleted_episodes = int(scalars["num_deleted_episodes"])

    # ------------------------------------------------------------------ leases
    def lease(self, held: Held) -> int:
        """Record a lease on ``held`` slots (their ``meta.leases`` already counted by the caller); its id."""
        lease_id = next(self._lease_ids)
        self.leases[lease_id] = held
        return lease_id

    def unlease(self, held: Held) -> list[int]:
        """Drop a lease's counts of its slots; returns the deleted slots this made free."""
        m = self.meta
        m.leases[held.slots] -= 1  # once per distinct slot
        if len(held.extra_slots):
            m.leases[held.extra_slots] -= held.extra.astype(np.int32)
        freed = []
        if self.zombies:
            for s in held.slots[m.leases[held.slots] == 0].tolist():
                if s in self.zombies:
                    self.zombies.remove(s)
                    self.free.append(s)
                    freed.append(s)
        return freed
