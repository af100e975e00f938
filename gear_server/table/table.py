"""A replay table: Reverb's semantics over slots, selectors, a rate limiter and a column store.

``Table`` is the facade: its state is a ``gear_server.table.core.TableCore``;
the insert path is ``table_insert``, the sample path (picks, leases, reads)
``table_sample``, placement, layout learning and growth ``layout_fitting``;
mutate, reset, checkpoints and lifecycle are here.

Each item occupies one slot (``gear_server.table.slots``) whose bytes live in the
table's shared-memory segment (``gear_server.table.columns``). ``capacity =
max_size + spare``: a deleted item's slot is not reused while a reader holds a
lease on it, and the spare slots let inserts go on meanwhile (the table grows
its capacity if even they run out). The maximum length comes from the
signature's leading (time) dimension, else from ``TableConfig.initial_max_length``
or the first item, and grows (doubling, items kept) when a longer item arrives.
Items are checked by ``gear_server.table.items`` (the one validator).

A table without a signature reports none (``TableInfo.signature`` unset, as in
Reverb); it learns its column layout (structure, dtypes, step shapes) from the
first item and keeps it internal (``layout()``). While it holds items, an item
of another layout is kept in the side store (``gear_server.table.side_store``), as
Reverb's tables hold items of any structure; such items are read inline only
(``sample(by_reference=True)`` refuses while any are held). Once the table is
empty again (``reset``, or every item removed) and no lease or copy is
outstanding, the next item relearns the column layout into a new segment
(layout version + 1). A signature compares flattened leaves (``items.Signature``).

Semantics follow Reverb (REVERB_COMPAT.md): insert-when-full then remove,
``max_times_sampled``, existing key = priority update, per-sample rate
limiting, deletes-before-updates in ``mutate_priorities``, ``reset``.
Priorities must be finite and >= 0: NaN, negative and infinite values raise
ValueError (an infinite priority would make every reported probability NaN).

Concurrency: one lock per table. An insert validates its item completely, waits
on the rate limiter, reserves a free slot, copies the bytes *outside* the lock
and publishes the item under it. Operations that move or clear slots (growth,
reset, restore, close) wait until no copy is in flight.
"""

from __future__ import annotations

import itertools
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
from gear_server.table.items import (
    ItemToInsert,
    ReservedItem,
    count_leaves,
    leaf_paths,
    priority_updates,
)
from gear_server.table.rate_limiter import RateLimiter
from gear_server.table.read_groups import ItemGroup
from gear_server.table.sample import Selection
from gear_server.table.selectors import make_selector
from gear_server.table.side_store import SideStore
from gear_server.table.slots import ItemMetadata, SlotBook
from gear_server.table.snapshot import RestorePlan, TableSnapshot, capture, jsonable

__all__ = ["ItemToInsert", "Selection", "Table", "TableSnapshot", "count_leaves", "leaf_paths"]


class Table:
    """A replay table (see module docstring)."""

    def __init__(self, config: pb.TableConfig, store: SegmentStore, *, seed: int | None = None,
                 spare_slots: int | None = None):
        self._state = TableCore(config, store, seed=seed, spare_slots=spare_slots)
        self.config: pb.TableConfig = self._state.config
        self.name: str = self._state.name
        self.max_size: int = self._state.max_size
        self.max_times_sampled: int = self._state.max_times_sampled

    # ------------------------------------------------------------------ queries
    @property
    def meta(self) -> ItemMetadata:
        """Per-slot metadata arrays (read by the selection kernels)."""
        return self._state.slots.meta

    @property
    def capacity(self) -> int:
        return self._state.capacity

    @property
    def segment(self) -> Segment | None:
        """The current segment (None until the first item fixes the layout)."""
        return self._state.columns.segment

    @property
    def _slots(self) -> SlotBook:
        """The slot book (tests and benchmarks look inside)."""
        return self._state.slots

    @property
    def _rate_limiter(self) -> RateLimiter:
        """The rate limiter (tests and benchmarks look inside)."""
        return self._state.rate_limiter

    def __len__(self) -> int:
        return len(self._state.slots)

    def size(self) -> int:
        with self._state.lock:
            return len(self._state.slots)

    def layout(self) -> TableLayout | None:
        """The storage layout (None until the first item fixes it).

        Read without the table's lock: a layout is immutable and replaced whole under the
        lock, so the reference read is atomic, and callers on the serving loop (Select,
        commits, metrics) never wait behind table work for it.
        """
        return self._state.columns.layout

    @property
    def closed(self) -> bool:
        return self._state.closed

    def can_sample(self, n: int = 1) -> bool:
        st = self._state
        with st.lock:
            return len(st.slots) > 0 and st.rate_limiter.can_sample(n)

    def can_insert(self, n: int = 1) -> bool:
        st = self._state
        with st.lock:
            return st.rate_limiter.can_insert(n)

    def wake_waiters(self) -> None:
        """Wake blocked inserts and samples so they re-check their ``abandoned`` callable (cancelled RPCs)."""
        st = self._state
        with st.lock:
            st.rate_limiter.wake_all()

    def signature(self) -> pb.Signature | None:
        """The configured signature (None without one; a learned layout is not a signature)."""
        sig = self._state.signature
        return sig.proto if sig is not None else None

    def info(self) -> pb.TableInfo:
        st = self._state
        with st.lock:
            info = pb.TableInfo(
                name=st.name, sampler_options=st.sampler.options, remover_options=st.remover.options,
                max_size=st.max_size, max_times_sampled=st.config.max_times_sampled,
                rate_limiter_info=st.rate_limiter.info(), current_size=len(st.slots),
                num_episodes=len(st.slots.episode_refs), num_deleted_episodes=st.slots.num_deleted_episodes,
                num_unique_samples=st.num_unique_samples, table_worker_time_ms=st.worker_time_s * 1e3,
                selection_state=st.sampler.selection_state(),
            )
            if st.signature is not None:
                info.signature.CopyFrom(st.signature.proto)
            return info

    def active_leases(self) -> int:
        with self._state.lock:
            return len(self._state.slots.leases)

    def holds_other_layouts(self) -> bool:
        """Whether some items are not in the column layout (so readers by reference cannot see them)."""
        with self._state.lock:
            return bool(self._state.side)

    # ------------------------------------------------------------------ insert (table_insert)
    def insert(self, item: ItemToInsert, timeout: float | None = None, abandoned: Abandoned = None) -> None:
        """Insert (or, for an existing key, update the priority of) one item.

        Blocks while the rate limiter forbids the insert; RateLimiterTimeout after
        ``timeout`` seconds (None: wait forever). ValueError for a bad item, which
        leaves the table unchanged.
        """
        table_insert.insert(self._state, item, timeout, abandoned)

    # ------------------------------------------------------------------ insert plane (table_reserve)
    def reserve(self, count: int) -> tuple[list[int], TableLayout | None]:
        """Take up to ``count`` free slots for an insert-plane writer to fill in the segment (growing
        capacity if needed); no slots and None while the table has no layout yet."""
        return table_reserve.reserve(self._state, count)

    def unreserve(self, slots: Iterable[int]) -> None:
        """Give back reserved slots that will not be committed (unknown ones are ignored)."""
        table_reserve.unreserve(self._state, slots)

    def commit_reserved(self, layout_version: int, item: ReservedItem, timeout: float | None = None,
                        abandoned: Abandoned = None) -> None:
        """Insert an item written into a reserved slot, as ``insert`` would; LayoutMoved (it stays
        reserved) when the table left ``layout_version``."""
        table_reserve.commit(self._state, layout_version, item, timeout, abandoned)

    # ------------------------------------------------------------------ sample / read / release (table_sample)
    def sample(self, num_samples: int, timeout: float | None = None, abandoned: Abandoned = None, *,
               by_reference: bool = False) -> Selection:
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
        """
        return table_sample.sample(self._state, num_samples, timeout, abandoned, by_reference=by_reference)

    def read(self, selection: Selection) -> list[np.ndarray]:
        """Copy the selected (leased) items' bytes: per column, the items' steps concatenated.

        Non-squeezed columns give ``[sum(lengths), *shape]``; squeezed ones ``[n, *shape]``.
        """
        return table_sample.read(self._state, selection)

    def slot_views(self, selection: Selection) -> list[list[np.ndarray]]:
        """Per column, one contiguous view per selected item of its steps in the segment (no copy).

        Valid while the selection's lease is held (a leased slot is never rewritten);
        joining them (e.g. ``b"".join``) gives the same bytes as ``read``.
        """
        return table_sample.slot_views(self._state, selection)

    def item_groups(self, selection: Selection) -> list[ItemGroup]:
        """The selected items in runs that share one layout, in selection order, as no-copy views.

        One group when every item is in the column layout (the common case); items of
        other layouts (tables without a signature) come in groups of their own.
        """
        return table_sample.item_groups(self._state, selection)

    def release(self, lease_id: int) -> None:
        """End a lease (unknown or already released ids are ignored)."""
        table_sample.release(self._state, lease_id)

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
        st = self._state
        if len(keys) != len(priorities):
            raise ValueError(f"{len(keys)} keys but {len(priorities)} priorities")
        prios = check_priorities(keys, priorities)
        delete_keys = list(deletes) if deletes is not None else []
        twice = len(keys) > 1 and len(set(keys)) != len(keys)
        with st.lock:
            st.check_open()
            t0 = time.perf_counter()
            k2s = st.slots.key_to_slot
            for key in delete_keys:
                slot = k2s.get(key)
                if slot is not None:
                    st.delete_slot(slot)
            if keys:
                slots = np.fromiter(map(k2s.get, keys, itertools.repeat(-1, len(keys))), np.int64, len(keys))
                if slots.min() < 0:
                    known = slots >= 0
                    slots, prios = slots[known], prios[known]
                if twice and len(slots):  # the last update of a key wins, in the given order of the survivors
                    keep = last_occurrences(slots)
                    slots, prios = slots[keep], prios[keep]
                if len(slots):
                    seqs = np.arange(st.seq + 1, st.seq + 1 + len(slots), dtype=np.int64)
                    st.seq += len(slots)
                    st.meta.priority[slots] = prios
                    st.meta.update_seq[slots] = seqs
                    st.sampler.update_many(slots, prios, seqs)
                    st.remover.update_many(slots, prios, seqs)
            st.worker_time_s += time.perf_counter() - t0

    def reset(self) -> None:
        """Empty the table and zero the rate limiter's counters (keys after it are new)."""
        st = self._state
        with st.lock:
            st.check_open()
            st.begin_exclusive()
            try:
                st.slots.clear()
                for slot in list(st.side.items):
                    if slot not in st.slots.zombies:  # leased ones stay readable until released
                        st.side.drop(slot)
                st.sampler.clear()
                st.remover.clear()
                st.num_unique_samples = 0
                st.rate_limiter.reset()
            finally:
                st.end_exclusive()

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> TableSnapshot:
        """Every piece of state as numpy arrays plus JSON-serialisable scalars (items in insertion order).

        See ``gear_server.table.snapshot.capture`` for the arrays; restoring puts every
        item back in its slot, so selection (which walks slots) repeats exactly.
        """
        st = self._state
        with st.lock:
            st.check_open()
            scalars = {
                "name": st.name, "seq": st.seq, "rate_limiter": st.rate_limiter.state(),
                "num_deleted_episodes": st.slots.num_deleted_episodes,
                "num_unique_samples": st.num_unique_samples, "table_worker_time_s": st.worker_time_s,
                "rng": jsonable(st.rng.bit_generator.state),
            }
            return capture(st.slots, st.columns, st.side, {"sampler": st.sampler, "remover": st.remover},
                           scalars)

    def restore(self, snapshot: TableSnapshot) -> None:
        """Load a snapshot into this (empty, unleased) table; it then behaves as the snapshotted one."""
        st = self._state
        plan = RestorePlan(snapshot, st.name, st.max_size,
                           st.signature.structure if st.signature is not None else None)
        s = snapshot.scalars
        with st.lock:
            st.check_open()
            st.begin_exclusive()
            try:
                if not st.slots.idle():
                    raise ValueError(f"table '{st.name}': restore needs an empty table without leases")
                capacity = plan.capacity(max(st.capacity, plan.num_items + st.spare))
                st.sampler = make_selector(st.config.sampler, capacity)
                st.remover = make_selector(st.config.remover, capacity)
                st.slots = SlotBook(capacity, len(plan.specs))
                if plan.structure is not None:
                    st.columns.structure = plan.structure
                if plan.specs:
                    st.columns.learn(plan.specs, plan.max_lengths, st.columns.structure, capacity)
                st.side = SideStore()
                plan.load(st.slots, st.columns, st.side, {"sampler": st.sampler, "remover": st.remover})
                st.seq = int(s["seq"])
                st.rate_limiter.restore(s["rate_limiter"])
                st.num_unique_samples = int(s["num_unique_samples"])
                st.worker_time_s = float(s.get("table_worker_time_s", 0.0))
                rng_state = s.get("rng")
                if rng_state and rng_state.get("bit_generator") == st.rng.bit_generator.state["bit_generator"]:
                    st.rng.bit_generator.state = rng_state
            finally:
                st.end_exclusive()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wake every waiter with TableClosedError and unlink the segment."""
        st = self._state
        with st.lock:
            if st.closed:
                return
            st.closed = True
            st.rate_limiter.cancel()
            st.cond.notify_all()
            while st.copies_in_flight:
                st.cond.wait()
            st.columns.close()

    def __repr__(self) -> str:
        st = self._state
        return f"Table(name={st.name!r}, size={len(st.slots)}, max_size={st.max_size})"
