"""TableCore: one table's parts and counters, and the steps every table operation shares.

A ``Table`` (``gear_server.table.table``) is a facade over one ``TableCore``; the
insert path (``table_insert``), the sample path (``table_sample``) and layout
fitting (``layout_fitting``) are functions over it. Everything here is guarded by
``lock``; ``cond`` (on the same lock) is notified when copies in flight end and
when an exclusive operation (growth, reset, restore, close) ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import TableClosedError
from gear_server.storage import SegmentStore
from gear_server.table.columns import MIN_INITIAL_SLOTS, ColumnStore
from gear_server.table.items import PreparedItem, Signature
from gear_server.table.rate_limiter import RateLimiter
from gear_server.table.selectors import make_selector
from gear_server.table.side_store import SideStore
from gear_server.table.slots import Held, ItemMetadata, SlotBook

Abandoned = Callable[[], bool] | None


def default_spare(max_size: int) -> int:
    """Spare slots beyond max_size (deleted items' slots stay leased meanwhile)."""
    return int(max(16, min(max_size // 8, 4096)))


class TableCore:
    """A table's configuration, parts (slots, selectors, rate limiter, column and side stores) and counters."""

    def __init__(self, config: pb.TableConfig, store: SegmentStore, *, seed: int | None = None,
                 spare_slots: int | None = None):
        if not config.name:
            raise ValueError("table name must not be empty")
        if config.max_size <= 0:
            raise ValueError(f"table '{config.name}': max_size must be > 0, got {config.max_size}")
        self.config = pb.TableConfig()
        self.config.CopyFrom(config)
        self.name: str = config.name
        self.max_size = int(config.max_size)
        self.max_times_sampled = int(config.max_times_sampled) if config.max_times_sampled > 0 else 0
        self.spare = int(spare_slots) if spare_slots is not None else default_spare(self.max_size)
        if self.spare < 1:
            raise ValueError("spare_slots must be >= 1")

        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # copies in flight / exclusive operations
        self.rate_limiter = RateLimiter(config.rate_limiter, self.lock)
        self.rng = np.random.default_rng(seed)

        self.signature = Signature(config.signature, self.name) if config.HasField("signature") else None
        capacity = min(self.max_size + self.spare, MIN_INITIAL_SLOTS)  # grows with the items (layout_fitting)
        self.sampler = make_selector(config.sampler, capacity)
        self.remover = make_selector(config.remover, capacity)
        self.slots = SlotBook(capacity, len(self.signature.leaves) if self.signature else 0)
        self.columns = ColumnStore(self.name, store, self.signature.structure if self.signature else None)
        self.side = SideStore()  # items of other layouts (tables without a signature)

        self.seq = 0  # orders inserts and priority updates
        self.num_unique_samples = 0
        self.worker_time_s = 0.0
        self.copies_in_flight = 0
        self.exclusive = False
        self.closed = False

    @property
    def meta(self) -> ItemMetadata:
        """Per-slot metadata arrays (read by the selection kernels)."""
        return self.slots.meta

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    # ------------------------------------------------------------------ shared steps (lock held)
    def check_open(self) -> None:
        if self.closed:
            raise TableClosedError(f"table '{self.name}' is closed")

    def existing_key(self, prep: PreparedItem) -> None:
        """An insert of a key the table holds: a priority update (Reverb), nothing for a writer's resend."""
        if not prep.resend:
            self.update_existing(prep.key, prep.priority)

    def update_existing(self, key: int, priority: float) -> None:
        slot = self.slots.key_to_slot[key]
        self.seq += 1
        self.meta.priority[slot] = priority
        self.meta.update_seq[slot] = self.seq
        self.sampler.update(slot, priority, self.seq)
        self.remover.update(slot, priority, self.seq)

    def delete_slot(self, slot: int) -> None:
        """Remove the item in ``slot``; the slot is freed once unleased."""
        self.slots.vacate(slot)
        if self.meta.leases[slot] == 0:
            self.side.drop(slot)  # a leased one stays readable until its last lease ends (unlease)
        self.sampler.delete(slot)
        self.remover.delete(slot)
        self.rate_limiter.deleted()

    def unlease(self, held: Held) -> None:
        had_zombies = bool(self.slots.zombies)
        for slot in self.slots.unlease(held):
            self.side.drop(slot)
        if had_zombies and (self.exclusive or self.copies_in_flight):
            self.cond.notify_all()

    def copy_done(self) -> None:
        self.copies_in_flight -= 1
        if self.copies_in_flight == 0:
            self.cond.notify_all()

    def begin_exclusive(self) -> None:
        """Wait for the other exclusive operation and every copy in flight; then nothing moves slots but us."""
        while self.exclusive:
            self.cond.wait()
        self.exclusive = True
        while self.copies_in_flight:
            self.cond.wait()

    def end_exclusive(self) -> None:
        self.exclusive = False
        self.cond.notify_all()

    def grow_slots(self, capacity: int) -> None:
        if capacity > self.capacity:
            self.slots.grow(capacity)
            self.sampler.resize(capacity)
            self.remover.resize(capacity)
