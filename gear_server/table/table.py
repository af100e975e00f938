"""Table: a replay table with Reverb's semantics (insert, sample, mutate, reset, info, checkpoints, close).

A facade over one ``TableCore`` (its parts and counters, under one lock); the
paths live beside it (``insert``, ``reserve``, ``sample``, ``fitting``,
``snapshot``). docs/DESIGN.md describes slots, layouts and concurrency;
docs/REVERB_COMPAT.md the semantics.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Mapping

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_contract.priorities import check_priorities
from gear_kernels.twins import last_occurrences
from gear_server.storage import Segment, SegmentStore
from gear_server.table import insert as table_insert
from gear_server.table import reserve as table_reserve
from gear_server.table import sample as table_sample
from gear_server.table.core import Abandoned, TableCore
from gear_server.table.fitting import regrow_locked
from gear_server.table.gpu_mirror import GpuMirror
from gear_server.table.items import (
    ItemToInsert,
    ReservedItem,
    count_leaves,
    leaf_paths,
    priority_updates,
)
from gear_server.table.rate_limiter import LimiterCounts
from gear_server.table.read_groups import ItemGroup
from gear_server.table.sample import Selection
from gear_server.table.slots import ItemMetadata, SlotCounts
from gear_server.table.snapshot import RestorePlan, TableSnapshot

__all__ = ["ItemToInsert", "Selection", "Table", "TableSnapshot", "count_leaves", "leaf_paths"]


class Table:
    """A replay table (see module docstring)."""

    def __init__(self, config: pb.TableConfig, store: SegmentStore, *, seed: int | None = None,
                 spare_slots: int | None = None):
        self._core = TableCore(config, store, seed=seed, spare_slots=spare_slots)
        self.config: pb.TableConfig = self._core.config
        self.name: str = self._core.name
        self.max_size: int = self._core.max_size
        self.max_times_sampled: int = self._core.max_times_sampled

    # ------------------------------------------------------------------ queries
    @property
    def meta(self) -> ItemMetadata:
        """Per-slot metadata arrays (read by the selection kernels)."""
        return self._core.slots.meta

    @property
    def capacity(self) -> int:
        return self._core.capacity

    @property
    def segment(self) -> Segment | None:
        """The current segment (None until the first item fixes the layout)."""
        return self._core.columns.segment

    @property
    def lock(self) -> threading.Lock:
        """The table's lock (read-only view): holding it pauses every operation on this table, as a
        snapshot or a segment growth does. For diagnostics and tests; the table's methods take it."""
        return self._core.lock

    def keys(self) -> list[int]:
        """The keys of the items held now (a copy), oldest insert first."""
        with self._core.lock:
            return list(self._core.slots.key_to_slot)

    def slot_of(self, key: int) -> int | None:
        """The slot holding the item of ``key`` (indexes ``meta``); None when the table does not hold it."""
        with self._core.lock:
            return self._core.slots.key_to_slot.get(int(key))

    def slot_counts(self) -> SlotCounts:
        """How the slots are used now (a copy): free, holding items, leased after a delete, reserved."""
        with self._core.lock:
            return self._core.slots.counts()

    def rate_limiter_counts(self) -> LimiterCounts:
        """The rate limiter's counters now (a copy): inserts, samples, deletes and inserts admitted but
        not yet committed."""
        with self._core.lock:
            return self._core.rate_limiter.counts()

    def __len__(self) -> int:
        return len(self._core.slots)

    def size(self) -> int:
        """Items held (taken under the lock; ``len`` reads without it)."""
        with self._core.lock:
            return len(self._core.slots)

    def layout(self) -> TableLayout | None:
        """The storage layout (None until the first item fixes it).

        Read without the table's lock: a layout is immutable and replaced whole under the
        lock, so the reference read is atomic, and callers on the serving loop (Select,
        commits, metrics) never wait behind table work for it.
        """
        return self._core.columns.layout

    @property
    def closed(self) -> bool:
        return self._core.closed

    def can_sample(self, n: int = 1) -> bool:
        core = self._core
        with core.lock:
            return len(core.slots) > 0 and core.rate_limiter.can_sample(n)

    def can_insert(self, n: int = 1) -> bool:
        core = self._core
        with core.lock:
            return core.rate_limiter.can_insert(n)

    def wake_waiters(self) -> None:
        """Wake blocked inserts and samples so they re-check their ``abandoned`` callable (cancelled RPCs)."""
        core = self._core
        with core.lock:
            core.rate_limiter.wake_all()

    def stop_sampling(self) -> None:
        """Take no more samples (a graceful stop drains): waiting and later samples end with SamplingStopped
        (UNAVAILABLE) having taken nothing; a sample already picking hands over what it took."""
        core = self._core
        with core.lock:
            core.rate_limiter.stop_sampling()

    def signature(self) -> pb.Signature | None:
        """The configured signature (None without one; a learned layout is not a signature)."""
        sig = self._core.signature
        return sig.proto if sig is not None else None

    def info(self) -> pb.TableInfo:
        core = self._core
        with core.lock:
            info = pb.TableInfo(
                name=core.name, sampler_options=core.sampler.options, remover_options=core.remover.options,
                max_size=core.max_size, max_times_sampled=core.config.max_times_sampled,
                rate_limiter_info=core.rate_limiter.info(), current_size=len(core.slots),
                num_episodes=len(core.slots.episode_refs), num_deleted_episodes=core.slots.num_deleted_episodes,
                num_unique_samples=core.num_unique_samples, table_worker_time_ms=core.worker_time_s * 1e3,
                selection_state=core.sampler.selection_state(),
            )
            if core.signature is not None:
                info.signature.CopyFrom(core.signature.proto)
            if core.mirror is not None:
                info.gpu_mirror.CopyFrom(core.mirror.info())
            return info

    def active_leases(self) -> int:
        with self._core.lock:
            return len(self._core.slots.leases)

    @property
    def mirror(self) -> GpuMirror | None:
        """The table's GPU-memory tier (None without ``gpu_mirror``)."""
        return self._core.mirror

    def holds_other_layouts(self) -> bool:
        """Whether some items are not in the column layout (so readers by reference cannot see them)."""
        with self._core.lock:
            return bool(self._core.side)

    # ------------------------------------------------------------------ insert (table_insert)
    def insert(self, item: ItemToInsert, timeout: float | None = None, abandoned: Abandoned = None) -> None:
        """Insert (or, for an existing key, update the priority of) one item.

        Blocks while the rate limiter forbids the insert; RateLimiterTimeout after
        ``timeout`` seconds (None: wait forever). ValueError for a bad item, which
        leaves the table unchanged.
        """
        table_insert.insert(self._core, item, timeout, abandoned)

    # ------------------------------------------------------------------ insert plane (table_reserve)
    def reserve(self, count: int) -> tuple[list[int], TableLayout | None]:
        """Take up to ``count`` free slots for an insert-plane writer to fill in the segment (growing
        capacity if needed); no slots and None while the table has no layout yet."""
        return table_reserve.reserve(self._core, count)

    def unreserve(self, slots: Iterable[int]) -> None:
        """Give back reserved slots that will not be committed (unknown ones are ignored)."""
        table_reserve.unreserve(self._core, slots)

    def commit_reserved(self, layout_version: int, item: ReservedItem, timeout: float | None = None,
                        abandoned: Abandoned = None) -> None:
        """Insert an item written into a reserved slot, as ``insert`` would; LayoutMoved (it stays
        reserved) when the table left ``layout_version``."""
        table_reserve.commit(self._core, layout_version, item, timeout, abandoned)

    # ------------------------------------------------------------------ sample / read / release (table_sample)
    def sample(self, num_samples: int, timeout: float | None = None, abandoned: Abandoned = None, *,
               by_reference: bool = False, rng: np.random.Generator | None = None) -> Selection:
        """Pick ``num_samples`` items, each as if sampled alone; lease their slots.

        Each pick passes the rate limiter (blocking between picks as needed),
        increments times_sampled (reported including this pick), reports the table
        size before any deletion it causes, and deletes the item when it reaches
        max_times_sampled. RateLimiterTimeout if not even one pick was allowed
        before ``timeout``; if the timeout passes after some picks, those are
        returned (fewer than asked, as Reverb's flexible batches).

        ``by_reference``: the caller reads the items from the segment (shm, rdma), which
        holds only the column layout's items: while the table holds items of other
        layouts it picks nothing (NeedsInlinePlane) or stops before them.

        ``rng``: the generator the picks are drawn from (default the table's own): a
        seeded one makes the picks reproducible for a given table state.
        """
        return table_sample.sample(self._core, num_samples, timeout, abandoned, by_reference=by_reference, rng=rng)

    def read(self, selection: Selection) -> list[np.ndarray]:
        """Copy the selected (leased) items' bytes: per column, the items' steps concatenated.

        Non-squeezed columns give ``[sum(lengths), *shape]``; squeezed ones ``[n, *shape]``.
        """
        return table_sample.read(self._core, selection)

    def slot_views(self, selection: Selection) -> list[list[np.ndarray]]:
        """Per column, one contiguous view per selected item of its steps in the segment (no copy).

        Valid while the selection's lease is held (a leased slot is never rewritten);
        joining them (e.g. ``b"".join``) gives the same bytes as ``read``.
        """
        return table_sample.slot_views(self._core, selection)

    def item_groups(self, selection: Selection) -> list[ItemGroup]:
        """The selected items in runs that share one layout, in selection order, as no-copy views.

        One group when every item is in the column layout (the common case); items of
        other layouts (tables without a signature) come in groups of their own.
        """
        return table_sample.item_groups(self._core, selection)

    def release(self, lease_id: int) -> None:
        """End a lease (unknown or already released ids are ignored)."""
        table_sample.release(self._core, lease_id)

    def split_lease(self, lease_id: int, start: int, stop: int) -> int:
        """Move picks [start, stop) of a lease to a new one (its id): a shared selection handed out in slices."""
        return table_sample.split_lease(self._core, lease_id, start, stop)

    # ------------------------------------------------------------------ mutate / reset
    def mutate_priorities(self, updates: Mapping[int, float] | Iterable[tuple[int, float]] | None = None,
                          deletes: Iterable[int] | None = None) -> None:
        """Delete ``deletes``, then set priorities; unknown keys are ignored (a key given twice: its last one).

        ValueError (nothing changed) if any new priority is NaN, negative or infinite.
        """
        keys, prios = priority_updates(updates)
        self.apply_priority_updates(keys, prios, deletes)

    def apply_priority_updates(self, keys: list[int], priorities: np.ndarray,
                               deletes: Iterable[int] | None = None) -> None:
        """``mutate_priorities`` of decoded arrays: ``keys[i]`` gets ``priorities[i]`` (float64)."""
        core = self._core
        if len(keys) != len(priorities):
            raise ValueError(f"{len(keys)} keys but {len(priorities)} priorities")
        prios = check_priorities(keys, priorities)
        delete_keys = list(deletes) if deletes is not None else []
        twice = len(keys) > 1 and len(set(keys)) != len(keys)
        with core.lock:
            core.check_open_locked()
            t0 = time.perf_counter()
            k2s = core.slots.key_to_slot
            for key in delete_keys:
                slot = k2s.get(key)
                if slot is not None:
                    core.delete_slot_locked(slot)
            if keys:
                slots = np.fromiter(map(k2s.get, keys, itertools.repeat(-1, len(keys))), np.int64, len(keys))
                if slots.min() < 0:
                    known = slots >= 0
                    slots, prios = slots[known], prios[known]
                if twice and len(slots):  # the last update of a key wins, in the given order of the survivors
                    keep = last_occurrences(slots)
                    slots, prios = slots[keep], prios[keep]
                if len(slots):
                    core.update_many_locked(slots, prios)
            core.add_worker_time_locked(t0)

    def reset(self) -> None:
        """Empty the table and zero the rate limiter's counters (keys after it are new)."""
        core = self._core
        with core.lock:
            core.check_open_locked()
            core.begin_exclusive_locked()
            try:
                core.clear_locked()
            finally:
                core.end_exclusive_locked()

    def grow(self, capacity: int) -> None:
        """Make room for at least ``capacity`` slots now (a new layout version, items kept), as inserts do
        when they need it; nothing before the first item fixes the layout."""
        core = self._core
        with core.lock:
            core.check_open_locked()
            if core.columns.learned:
                regrow_locked(core, int(capacity), None)

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> TableSnapshot:
        """Every piece of state as numpy arrays plus JSON-serialisable scalars (items in insertion order).

        See ``gear_server.table.snapshot.capture`` for the arrays; restoring puts every
        item back in its slot, so selection (which walks slots) repeats exactly.
        """
        core = self._core
        with core.lock:
            core.check_open_locked()
            return core.snapshot_locked()

    def restore(self, snapshot: TableSnapshot) -> None:
        """Load a snapshot into this (empty, unleased) table; it then behaves as the snapshotted one.

        Raises:
            ValueError: the snapshot does not fit this table (too many items, another signature, duplicate
                keys or slots) or the table holds items or leases; the table is left as it was.
        """
        core = self._core
        plan = RestorePlan(snapshot, core.name, core.max_size,
                           core.signature.structure if core.signature is not None else None)
        with core.lock:
            core.check_open_locked()
            core.begin_exclusive_locked()
            try:
                core.restore_locked(plan)
            finally:
                core.end_exclusive_locked()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wake every waiter with TableClosedError and unlink the segment."""
        with self._core.lock:
            self._core.close_locked()
        if self._core.mirror is not None:
            self._core.mirror.close()  # outside the lock: its thread takes it

    def __repr__(self) -> str:
        core = self._core
        return f"Table(name={core.name!r}, size={len(core.slots)}, max_size={core.max_size})"
