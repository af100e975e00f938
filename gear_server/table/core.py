"""TableCore: one table's parts and counters, and the steps every table operation shares.

A ``Table`` (``gear_server.table.table``) is a facade over one ``TableCore``; the
insert path (``insert``), the sample path (``sample``), the insert plane's
reservations (``reserve``) and layout fitting (``fitting``) are functions over it.

Everything here is guarded by ``lock``. A method or function whose name ends in
``_locked`` must be called with it held; the parts (``slots``, ``columns``,
``side``, ``sampler``, ``remover``) are single-threaded objects that the table
only touches under it. The counters (sequence numbers, copies in flight, worker
time, unique samples) and the exclusive/closed flags change only through the
methods here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import TableClosedError
from gear_server.storage import SegmentStore
from gear_server.table.columns import MIN_INITIAL_SLOTS, ColumnStore
from gear_server.table.gpu_mirror import GpuMirror, MirrorSpec
from gear_server.table.items import PreparedItem, Signature
from gear_server.table.rate_limiter import RateLimiter
from gear_server.table.selectors import make_selector
from gear_server.table.side_store import SideStore
from gear_server.table.slots import Held, ItemMetadata, SlotBook
from gear_server.table.snapshot import RestorePlan, TableSnapshot, capture, jsonable

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
        self._cond = threading.Condition(self.lock)  # copies in flight / exclusive operations end
        self.rate_limiter = RateLimiter(config.rate_limiter, self.lock)
        self.rng = np.random.default_rng(seed)

        self.signature = Signature(config.signature, self.name) if config.HasField("signature") else None
        capacity = min(self.max_size + self.spare, MIN_INITIAL_SLOTS)  # grows with the items (fitting)
        self.sampler = make_selector(config.sampler, capacity)
        self.remover = make_selector(config.remover, capacity)
        self.slots = SlotBook(capacity, len(self.signature.leaves) if self.signature else 0)
        self.columns = ColumnStore(self.name, store, self.signature.structure if self.signature else None)
        self.side = SideStore()  # items of other layouts (tables without a signature)

        self._seq = 0  # orders inserts and priority updates
        self._num_unique_samples = 0
        self._worker_time_s = 0.0
        self._copies_in_flight = 0
        self._exclusive = False
        self._closed = False
        # The GPU-memory tier (gear_server.table.gpu_mirror); last, so a refused one leaves nothing to undo.
        self.mirror: GpuMirror | None = None
        if config.HasField("gpu_mirror"):
            spec = MirrorSpec.from_proto(config.gpu_mirror, self.name)
            self.mirror = GpuMirror(self, spec, store.segment_path(f"{self.name}/gpu-mirror", 0))

    # ------------------------------------------------------------------ read-only views
    @property
    def meta(self) -> ItemMetadata:
        """Per-slot metadata arrays (read by the selection kernels)."""
        return self.slots.meta

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def copies_in_flight(self) -> int:
        """Inserts copying their bytes outside the lock now."""
        return self._copies_in_flight

    @property
    def num_unique_samples(self) -> int:
        return self._num_unique_samples

    @property
    def worker_time_s(self) -> float:
        """Seconds spent on table work under the lock (inserts, samples, priority updates)."""
        return self._worker_time_s

    # ------------------------------------------------------------------ counters (lock held)
    def next_seq_locked(self, n: int = 1) -> int:
        """Take ``n`` sequence numbers (they order inserts and priority updates); the first of them.

        The caller holds the lock.
        """
        first = self._seq + 1
        self._seq += n
        return first

    def add_worker_time_locked(self, started: float) -> None:
        """Count the table work since ``time.perf_counter()`` read ``started`` (TableInfo's worker time).

        The caller holds the lock.
        """
        self._worker_time_s += time.perf_counter() - started

    def count_unique_samples_locked(self, n: int) -> None:
        """Count ``n`` picks of items never sampled before. The caller holds the lock."""
        self._num_unique_samples += n

    # ------------------------------------------------------------------ shared steps (lock held)
    def check_open_locked(self) -> None:
        """TableClosedError once the table is closed. The caller holds the lock."""
        if self._closed:
            raise TableClosedError(f"table '{self.name}' is closed")

    def existing_key_locked(self, prep: PreparedItem) -> None:
        """An insert of a key the table holds: a priority update (Reverb), nothing for a writer's resend.

        The caller holds the lock.
        """
        if not prep.resend:
            self.update_existing_locked(prep.key, prep.priority)

    def update_existing_locked(self, key: int, priority: float) -> None:
        """Set the priority of the item of ``key`` (which the table holds). The caller holds the lock."""
        slot = self.slots.key_to_slot[key]
        seq = self.next_seq_locked()
        self.slots.set_priorities(slot, priority, seq)
        self.sampler.update(slot, priority, seq)
        self.remover.update(slot, priority, seq)

    def update_many_locked(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Set ``priorities[i]`` on the item in ``slots[i]`` (distinct slots holding items), in order.

        The caller holds the lock.
        """
        first = self.next_seq_locked(len(slots))
        seqs = np.arange(first, first + len(slots), dtype=np.int64)
        self.slots.set_priorities(slots, priorities, seqs)
        self.sampler.update_many(slots, priorities, seqs)
        self.remover.update_many(slots, priorities, seqs)

    def delete_slot_locked(self, slot: int) -> None:
        """Remove the item in ``slot``; the slot is freed once unleased. The caller holds the lock."""
        self.slots.vacate(slot)
        if self.meta.leases[slot] == 0:
            self.side.drop(slot)  # a leased one stays readable until its last lease ends (unlease)
        self.sampler.delete(slot)
        self.remover.delete(slot)
        self.rate_limiter.deleted()
        if self.mirror is not None:
            self.mirror.removed(slot)

    def unlease_locked(self, held: Held) -> None:
        """End a lease's hold on its slots (deleted items' slots it was the last to hold become free).

        The caller holds the lock.
        """
        had_zombies = bool(self.slots.zombies)
        for slot in self.slots.unlease(held):
            self.side.drop(slot)
            if self.mirror is not None:
                self.mirror.removed(slot)
        if had_zombies and (self._exclusive or self._copies_in_flight):
            self._cond.notify_all()

    def copy_started_locked(self) -> None:
        """An insert copies into its slot outside the lock: growth, reset, restore and close wait for it.

        The caller holds the lock; every call is paired with one ``copy_done_locked``.
        """
        self._copies_in_flight += 1

    def copy_done_locked(self) -> None:
        """A copy started by ``copy_started_locked`` ended. The caller holds the lock."""
        self._copies_in_flight -= 1
        if self._copies_in_flight == 0:
            self._cond.notify_all()

    def wait_for_exclusive_locked(self) -> bool:
        """If an exclusive operation runs, wait once for a change (it ends, or a copy ends) and return True
        (the caller re-checks what it saw); False at once when none runs. The caller holds the lock."""
        if not self._exclusive:
            return False
        self._cond.wait()
        return True

    def begin_exclusive_locked(self) -> None:
        """Wait for the other exclusive operation and every copy in flight; then nothing moves slots but us.

        The caller holds the lock (released while waiting) and calls ``end_exclusive_locked`` after.
        """
        while self._exclusive:
            self._cond.wait()
        self._exclusive = True
        while self._copies_in_flight:
            self._cond.wait()

    def end_exclusive_locked(self) -> None:
        """End the exclusive operation ``begin_exclusive_locked`` began. The caller holds the lock."""
        self._exclusive = False
        self._cond.notify_all()

    def grow_slots_locked(self, capacity: int) -> None:
        """Room for ``capacity`` slots in the book and selectors. The caller holds the lock."""
        if capacity > self.capacity:
            self.slots.grow(capacity)
            self.sampler.resize(capacity)
            self.remover.resize(capacity)

    # ------------------------------------------------------------------ whole-table operations (lock held)
    def clear_locked(self) -> None:
        """Remove every item and zero the rate limiter's counters (``Table.reset``); leased items stay
        readable until released. The caller holds the lock and runs it exclusively."""
        self.slots.clear()
        self.side.keep_only(self.slots.zombies)  # leased ones stay readable until released
        self.sampler.clear()
        self.remover.clear()
        self._num_unique_samples = 0
        self.rate_limiter.reset()
        if self.mirror is not None:
            self.mirror.clear()

    def snapshot_locked(self) -> TableSnapshot:
        """Every piece of the table's state (``Table.snapshot``). The caller holds the lock."""
        scalars: dict[str, Any] = {
            "name": self.name, "seq": self._seq, "rate_limiter": self.rate_limiter.state(),
            "num_unique_samples": self._num_unique_samples, "table_worker_time_s": self._worker_time_s,
            "rng": jsonable(self.rng.bit_generator.state),
        }
        return capture(self.slots, self.columns, self.side, self._selectors(), scalars)

    def restore_locked(self, plan: RestorePlan) -> None:
        """Load a checked snapshot into this empty, unleased table (``Table.restore``).

        The caller holds the lock and runs it exclusively.
        """
        if not self.slots.idle():
            raise ValueError(f"table '{self.name}': restore needs an empty table without leases")
        capacity = plan.capacity(max(self.capacity, plan.num_items + self.spare))
        self.sampler = make_selector(self.config.sampler, capacity)
        self.remover = make_selector(self.config.remover, capacity)
        self.slots = SlotBook(capacity, len(plan.specs))
        self.side = SideStore()
        plan.load(self.slots, self.columns, self.side, self._selectors())
        s = plan.scalars
        self._seq = int(s["seq"])
        self.rate_limiter.restore(s["rate_limiter"])
        self._num_unique_samples = int(s["num_unique_samples"])
        self._worker_time_s = float(s.get("table_worker_time_s", 0.0))
        rng_state = s.get("rng")
        if rng_state and rng_state.get("bit_generator") == self.rng.bit_generator.state["bit_generator"]:
            self.rng.bit_generator.state = rng_state
        if self.mirror is not None:  # the restored items, newest last, are copied as if just inserted
            self.mirror.clear()
            slots = self.slots.occupied_in_insert_order()
            self.mirror.committed_many(slots, self.meta.generation[slots])

    def close_locked(self) -> None:
        """Wake every waiter with TableClosedError, wait for the copies in flight and release the segment.

        The caller holds the lock. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self.rate_limiter.cancel()
        self._cond.notify_all()
        while self._copies_in_flight:
            self._cond.wait()
        self.columns.close()

    def _selectors(self) -> dict[str, Any]:
        return {"sampler": self.sampler, "remover": self.remover}
