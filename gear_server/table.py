"""A replay table: Reverb's semantics over slots, selectors, a rate limiter and a column store.

Each item occupies one slot (``gear_server.slots``) whose bytes live in the
table's shared-memory segment (``gear_server.column_store``). ``capacity =
max_size + spare``: a deleted item's slot is not reused while a reader holds a
lease on it, and the spare slots let inserts go on meanwhile (the table grows
its capacity if even they run out). The maximum length comes from the
signature's leading (time) dimension, else from ``TableConfig.initial_max_length``
or the first item, and grows (doubling, items kept) when a longer item arrives.
Items are checked by ``gear_server.items`` (the one validator).

A table without a signature reports none (``TableInfo.signature`` unset, as in
Reverb); it learns its column layout (structure, dtypes, step shapes) from the
first item and keeps it internal (``layout()``). While it holds items, an item
of another layout is kept in the side store (``gear_server.side_items``), as
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

import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_server.column_store import MIN_INITIAL_SLOTS, ColumnStore, gather, slot_views, write_item
from gear_server.errors import CallCancelled, NeedsInlinePlane, RateLimiterTimeout, TableClosedError
from gear_server.item_groups import ItemGroup, group_items
from gear_server.items import (  # noqa: F401 (ItemToInsert, count_leaves, leaf_paths: re-exported)
    ColumnSpec,
    ItemToInsert,
    PreparedItem,
    Signature,
    count_leaves,
    leaf_paths,
    priority_updates,
)
from gear_server.rate_limiter import RateLimiter, deadline_after
from gear_server.sampling import count_picks
from gear_server.selectors import make_selector
from gear_server.side_items import SideItem, SideStore
from gear_server.slots import ItemMetadata, SlotBook
from gear_server.storage import Segment, SegmentStore
from gear_server.table_snapshot import RestorePlan, TableSnapshot, capture, jsonable

Abandoned = Callable[[], bool] | None


class Placement(enum.Enum):
    """Where an item goes."""

    COLUMNS = "columns"  # the column slots of the learned (or signed) layout
    RELEARN = "relearn"  # the table is empty and idle: its layout is learned anew from this item
    SIDE = "side"  # another layout while the table holds items: the side store (no signature only)


@dataclass
class Selection:
    """Items picked by one ``sample`` call (leased until ``release(lease_id)``)."""

    slots: np.ndarray  # int64[n]
    generations: np.ndarray  # uint64[n]
    lengths: np.ndarray  # int32[n, C]
    keys: np.ndarray  # uint64[n]
    probabilities: np.ndarray  # float64[n]
    table_sizes: np.ndarray  # int64[n]
    priorities: np.ndarray  # float64[n]
    times_sampled: np.ndarray  # int32[n]
    lease_id: int
    layout_version: int

    def __len__(self) -> int:
        return len(self.slots)


def _default_spare(max_size: int) -> int:
    return int(max(16, min(max_size // 8, 4096)))


class Table:
    """A replay table (see module docstring)."""

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
        self._spare = int(spare_slots) if spare_slots is not None else _default_spare(self.max_size)
        if self._spare < 1:
            raise ValueError("spare_slots must be >= 1")

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # copies in flight / exclusive operations
        self._rate_limiter = RateLimiter(config.rate_limiter, self._lock)
        self._rng = np.random.default_rng(seed)

        self._signature = Signature(config.signature, self.name) if config.HasField("signature") else None
        capacity = min(self.max_size + self._spare, MIN_INITIAL_SLOTS)  # grows with the items (see _learn_layout)
        self._sampler = make_selector(config.sampler, capacity)
        self._remover = make_selector(config.remover, capacity)
        self._slots = SlotBook(capacity, len(self._signature.leaves) if self._signature else 0)
        self._columns = ColumnStore(self.name, store, self._signature.structure if self._signature else None)
        self._side = SideStore()  # items of other layouts (tables without a signature)

        self._seq = 0  # orders inserts and priority updates
        self._num_unique_samples = 0
        self._worker_time_s = 0.0
        self._copies_in_flight = 0
        self._exclusive = False
        self._closed = False

    # ------------------------------------------------------------------ queries
    @property
    def meta(self) -> ItemMetadata:
        """Per-slot metadata arrays (read by the selection kernels)."""
        return self._slots.meta

    @property
    def capacity(self) -> int:
        return self._slots.capacity

    @property
    def segment(self) -> Segment | None:
        """The current segment (None until the first item fixes the layout)."""
        return self._columns.segment

    def __len__(self) -> int:
        return len(self._slots)

    def size(self) -> int:
        with self._lock:
            return len(self._slots)

    def layout(self) -> TableLayout | None:
        """The storage layout (None until the first item fixes it)."""
        with self._lock:
            return self._columns.layout

    @property
    def closed(self) -> bool:
        return self._closed

    def can_sample(self, n: int = 1) -> bool:
        with self._lock:
            return len(self._slots) > 0 and self._rate_limiter.can_sample(n)

    def can_insert(self, n: int = 1) -> bool:
        with self._lock:
            return self._rate_limiter.can_insert(n)

    def wake_waiters(self) -> None:
        """Wake blocked inserts and samples so they re-check their ``abandoned`` callable (cancelled RPCs)."""
        with self._lock:
            self._rate_limiter.wake_all()

    def signature(self) -> pb.Signature | None:
        """The configured signature (None without one; a learned layout is not a signature)."""
        return self._signature.proto if self._signature is not None else None

    def info(self) -> pb.TableInfo:
        with self._lock:
            info = pb.TableInfo(
                name=self.name, sampler_options=self._sampler.options, remover_options=self._remover.options,
                max_size=self.max_size, max_times_sampled=self.config.max_times_sampled,
                rate_limiter_info=self._rate_limiter.info(), current_size=len(self._slots),
                num_episodes=len(self._slots.episode_refs), num_deleted_episodes=self._slots.num_deleted_episodes,
                num_unique_samples=self._num_unique_samples, table_worker_time_ms=self._worker_time_s * 1e3,
                selection_state=self._sampler.selection_state(),
            )
            if self._signature is not None:
                info.signature.CopyFrom(self._signature.proto)
            return info

    def active_leases(self) -> int:
        with self._lock:
            return len(self._slots.leases)

    # ------------------------------------------------------------------ fitting an item to the table
    def _can_relearn(self) -> bool:
        """Whether a signature-less table may take a new layout now: it holds no item, lease or copy (lock held)."""
        return (self._signature is None and self._columns.learned and self._slots.idle()
                and not self._copies_in_flight)

    def _placement(self, prep: PreparedItem) -> Placement:
        """Where the item goes (lock held): the column slots, a relearned layout (the table is empty and
        idle), or the side store (a signature-less table holding items of another layout). With a
        signature the item must fit it (ValueError naming the leaf otherwise)."""
        if not self._columns.learned:
            self._check_fits(prep)
            return Placement.COLUMNS
        if self._columns.fits(prep):
            self._check_fits(prep)
            return Placement.COLUMNS
        if self._can_relearn():
            return Placement.RELEARN
        if self._signature is None:
            return Placement.SIDE
        self._check_fits(prep)
        return Placement.COLUMNS

    def _check_fits(self, prep: PreparedItem) -> None:
        """ValueError unless the item matches the signature and the learned layout (lock held)."""
        # a signature compares flattened leaves (Reverb); a learned layout the whole structure
        why = self._columns.structure_mismatch(prep) if self._signature is None else None
        if why is None and self._signature is not None:
            try:
                self._signature.check(prep)
            except ValueError as e:
                why = str(e)
        if why is None:
            why = self._columns.layout_mismatch(prep)
        if why is not None:
            raise ValueError(why)

    # ------------------------------------------------------------------ insert
    def insert(self, item: ItemToInsert, timeout: float | None = None, abandoned: Abandoned = None) -> None:
        """Insert (or, for an existing key, update the priority of) one item.

        Blocks while the rate limiter forbids the insert; RateLimiterTimeout after
        ``timeout`` seconds (None: wait forever). ValueError for a bad item, which
        leaves the table unchanged.
        """
        deadline = deadline_after(timeout)
        prep = item.validated()
        with self._lock:
            self._check_open()
            placement = self._placement(prep)
            if prep.key in self._slots.key_to_slot:
                self._existing_key(prep)
                return
            epoch = self._columns.epoch
            self._rate_limiter.await_insert(deadline, abandoned)
            try:
                while True:
                    self._check_open()
                    if epoch != self._columns.epoch:
                        epoch = self._columns.epoch
                        placement = self._placement(prep)
                    if prep.key in self._slots.key_to_slot:
                        self._existing_key(prep)
                        self._rate_limiter.insert_abandoned()
                        return
                    if self._exclusive:
                        self._cond.wait()
                        continue
                    if not self._columns.learned or placement is Placement.RELEARN:
                        if placement is Placement.RELEARN and not self._can_relearn():  # items or leases came
                            placement = self._placement(prep)
                            continue
                        self._learn_layout(prep)
                        continue
                    if placement is Placement.COLUMNS:
                        grown = self._columns.grown_lengths(prep.lengths)
                        if grown is not None:
                            self._regrow(self.capacity, grown)
                            continue
                    if not self._slots.free:
                        self._regrow(self._next_capacity(), None)
                        continue
                    break
                if placement is Placement.COLUMNS:
                    self._columns.reserve(self._slots.free[-1])  # its memory, before anyone writes there
                slot = self._slots.take()
                self._copies_in_flight += 1
                views = self._columns.views
            except BaseException:
                self._rate_limiter.insert_abandoned()
                raise
        committed = False
        try:
            side = None
            if placement is Placement.SIDE:
                side = SideItem.of(prep)
            else:
                write_item(views, slot, prep.pieces)
            with self._lock:
                self._copy_done()
                committed = True
                self._commit(slot, prep, side)
        except BaseException:
            with self._lock:
                if not committed:
                    self._copy_done()
                    self._slots.give_back(slot)
                    self._rate_limiter.insert_abandoned()
            raise

    def _commit(self, slot: int, prep: PreparedItem, side: SideItem | None) -> None:
        t0 = time.perf_counter()
        if self._closed:
            self._slots.give_back(slot)
            self._rate_limiter.insert_abandoned()
            raise TableClosedError(f"table '{self.name}' closed during the insert")
        if prep.key in self._slots.key_to_slot:  # another insert of this key won the race
            self._slots.give_back(slot)
            self._existing_key(prep)
            self._rate_limiter.insert_abandoned()
            return
        self._seq += 1
        seq = self._seq
        if side is None:
            self._side.drop(slot)
            self._slots.occupy(slot, prep, seq, prep.lengths)
        else:
            self._slots.occupy(slot, prep, seq, 0)  # its lengths are the side item's
            self._side.put(slot, side)
        self._sampler.insert(slot, prep.priority, seq)
        self._remover.insert(slot, prep.priority, seq)
        if len(self._slots) > self.max_size:
            victim = self._remover.pick_one(self._rng)
            self._delete_slot(victim)
        self._rate_limiter.insert_committed()
        self._worker_time_s += time.perf_counter() - t0

    def _existing_key(self, prep: PreparedItem) -> None:
        """An insert of a key the table holds: a priority update (Reverb), nothing for a writer's resend."""
        if not prep.resend:
            self._update_existing(prep.key, prep.priority)

    def _update_existing(self, key: int, priority: float) -> None:
        slot = self._slots.key_to_slot[key]
        self._seq += 1
        self.meta.priority[slot] = priority
        self.meta.update_seq[slot] = self._seq
        self._sampler.update(slot, priority, self._seq)
        self._remover.update(slot, priority, self._seq)

    def _copy_done(self) -> None:
        self._copies_in_flight -= 1
        if self._copies_in_flight == 0:
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise TableClosedError(f"table '{self.name}' is closed")

    def _delete_slot(self, slot: int) -> None:
        """Remove the item in ``slot`` (lock held); the slot is freed once unleased."""
        self._slots.vacate(slot)
        if self.meta.leases[slot] == 0:
            self._side.drop(slot)  # a leased one stays readable until its last lease ends (_unlease)
        self._sampler.delete(slot)
        self._remover.delete(slot)
        self._rate_limiter.deleted()

    # ------------------------------------------------------------------ sample
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
        n = int(num_samples)
        if n < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        deadline = deadline_after(timeout)
        chunks: list[tuple] = []
        taken = 0
        rl = self._rate_limiter
        with self._lock:
            self._check_open()
            while taken < n:
                k = rl.samples_allowed_now(n - taken) if self._slots.key_to_slot else 0
                if k == 0:
                    try:
                        rl.await_sample(deadline, ready=self._has_items, abandoned=abandoned)
                    except RateLimiterTimeout:
                        if taken:
                            break
                        raise
                    except (TableClosedError, CallCancelled):
                        for chunk in chunks:
                            self._unlease(chunk[0])
                        raise
                    k = 1
                if by_reference and self._side:
                    if taken:
                        break
                    raise NeedsInlinePlane(f"table '{self.name}' holds items of {self._layouts_held()} layouts "
                                           "(structures, dtypes or step shapes); they are read inline")
                t0 = time.perf_counter()
                chunk = self._pick(k)
                chunks.append(chunk)
                got = len(chunk[0])
                taken += got
                rl.sampled(got)
                self._worker_time_s += time.perf_counter() - t0
            if len(chunks) == 1:
                slots, keys, probs, sizes, priorities, times = chunks[0]
            else:
                slots, keys, probs, sizes, priorities, times = (np.concatenate(parts)
                                                                for parts in zip(*chunks, strict=True))
            lease_id = self._slots.lease(slots)
            m = self.meta
            return Selection(
                slots=slots, generations=m.generation[slots], lengths=m.length[slots], keys=keys,
                probabilities=probs, table_sizes=sizes, priorities=priorities, times_sampled=times,
                lease_id=lease_id, layout_version=self._columns.version,
            )

    def _layouts_held(self) -> int:
        return len({item.layout_key for item in self._side.items.values()}) + (len(self._side) < len(self._slots))

    def holds_other_layouts(self) -> bool:
        """Whether some items are not in the column layout (so readers by reference cannot see them)."""
        with self._lock:
            return bool(self._side)

    def _has_items(self) -> bool:
        return bool(self._slots.key_to_slot)

    def _pick(self, k: int) -> tuple:
        """Up to k picks that see the same table (lock held); stops after a pick that deletes its item."""
        slots, probs = self._sampler.sample(k, self._rng)
        picks = count_picks(self.meta, slots, probs, self.max_times_sampled, len(self._slots))
        self._num_unique_samples += picks.first_samples
        if picks.deletes_last:
            self._delete_slot(int(picks.slots[-1]))
        return picks.chunk

    # ------------------------------------------------------------------ read / release
    def read(self, selection: Selection) -> list[np.ndarray]:
        """Copy the selected (leased) items' bytes: per column, the items' steps concatenated.

        Non-squeezed columns give ``[sum(lengths), *shape]``; squeezed ones ``[n, *shape]``.
        """
        views, specs, side = self._leased_views(selection)
        if side:
            raise ValueError("the selection holds items of other layouts than the table's columns: use item_groups")
        return gather(views, specs, selection.slots, selection.lengths)

    def slot_views(self, selection: Selection) -> list[list[np.ndarray]]:
        """Per column, one contiguous view per selected item of its steps in the segment (no copy).

        Valid while the selection's lease is held (a leased slot is never rewritten);
        joining them (e.g. ``b"".join``) gives the same bytes as ``read``.
        """
        views, specs, side = self._leased_views(selection)
        if side:
            raise ValueError("the selection holds items of other layouts than the table's columns: use item_groups")
        return slot_views(views, specs, selection.slots, selection.lengths)

    def item_groups(self, selection: Selection) -> list[ItemGroup]:
        """The selected items in runs that share one layout, in selection order, as no-copy views.

        One group when every item is in the column layout (the common case); items of
        other layouts (tables without a signature) come in groups of their own.
        """
        views, specs, side = self._leased_views(selection)
        return group_items(selection.slots, selection.lengths, views, specs, self.layout().structure, side)

    def _leased_views(self, selection: Selection
                      ) -> tuple[list[np.ndarray], list[ColumnSpec], dict[int, SideItem]]:
        """The column views and specs to read ``selection`` from, once its lease is confirmed held,
        and the selected side items by slot.

        Read outside the lock: leased slots are never rewritten, and each view holds an
        export of its mapping, so a segment replaced meanwhile (growth) stays mapped.
        """
        with self._lock:
            self._check_open()
            if selection.lease_id not in self._slots.leases:
                raise ValueError(f"lease {selection.lease_id} is not held on table '{self.name}'")
            side = {}
            if self._side:
                items = self._side.items
                side = {s: items[s] for s in selection.slots.tolist() if s in items}
            return self._columns.views, self._columns.specs, side

    def release(self, lease_id: int) -> None:
        """End a lease (unknown or already released ids are ignored)."""
        with self._lock:
            slots = self._slots.leases.pop(int(lease_id), None)
            if slots is not None:
                self._unlease(slots)

    def _unlease(self, slots: np.ndarray) -> None:
        had_zombies = bool(self._slots.zombies)
        for slot in self._slots.unlease(slots):
            self._side.drop(slot)
        if had_zombies and (self._exclusive or self._copies_in_flight):
            self._cond.notify_all()

    # ------------------------------------------------------------------ mutate / reset
    def mutate_priorities(self, updates: Mapping[int, float] | Iterable[tuple[int, float]] | None = None,
                          deletes: Iterable[int] | None = None) -> None:
        """Delete ``deletes``, then set priorities; unknown keys are ignored.

        ValueError (nothing changed) if any new priority is NaN, negative or infinite.
        """
        keys, prios = priority_updates(updates)
        delete_keys = list(deletes) if deletes is not None else []
        with self._lock:
            self._check_open()
            t0 = time.perf_counter()
            k2s = self._slots.key_to_slot
            for key in delete_keys:
                slot = k2s.get(key)
                if slot is not None:
                    self._delete_slot(slot)
            if keys:
                slots = np.fromiter((k2s.get(k, -1) for k in keys), np.int64, len(keys))
                known = slots >= 0
                slots, values = slots[known], prios[known]
                if not isinstance(updates, Mapping) and len(np.unique(slots)) != len(slots):
                    # the last update of a key wins; keep the given order of the survivors
                    _, last_rev = np.unique(slots[::-1], return_index=True)
                    keep = np.sort(len(slots) - 1 - last_rev)
                    slots, values = slots[keep], values[keep]
                if len(slots):
                    seqs = np.arange(self._seq + 1, self._seq + 1 + len(slots), dtype=np.int64)
                    self._seq += len(slots)
                    self.meta.priority[slots] = values
                    self.meta.update_seq[slots] = seqs
                    self._sampler.update_many(slots, values, seqs)
                    self._remover.update_many(slots, values, seqs)
            self._worker_time_s += time.perf_counter() - t0

    def reset(self) -> None:
        """Empty the table and zero the rate limiter's counters (keys after it are new)."""
        with self._lock:
            self._check_open()
            self._begin_exclusive()
            try:
                self._slots.clear()
                for slot in list(self._side.items):
                    if slot not in self._slots.zombies:  # leased ones stay readable until released
                        self._side.drop(slot)
                self._sampler.clear()
                self._remover.clear()
                self._num_unique_samples = 0
                self._rate_limiter.reset()
            finally:
                self._end_exclusive()

    # ------------------------------------------------------------------ exclusive ops
    def _begin_exclusive(self) -> None:
        while self._exclusive:
            self._cond.wait()
        self._exclusive = True
        while self._copies_in_flight:
            self._cond.wait()

    def _end_exclusive(self) -> None:
        self._exclusive = False
        self._cond.notify_all()

    # ------------------------------------------------------------------ layout and growth
    def _learn_layout(self, prep: PreparedItem) -> None:
        """Fix the column specs from the first item, or relearn them from an item that breaks the
        learned ones while the table holds nothing, and create the segment (lock held).

        A relearned layout gets a new segment (version + 1, the old one is released) and a new
        layout epoch, so waiting inserts re-validate and data-plane sessions fetch the new layout.
        """
        self._begin_exclusive()
        try:
            if self._columns.learned and not (self._can_relearn() and not self._columns.fits(prep)):
                return  # learned meanwhile (and the item fits, or it is refused by the caller)
            sig = self._signature
            names = sig.names() if sig is not None else leaf_paths(prep.structure)
            specs = [ColumnSpec(names[c], dtype, tuple(shape), squeezed)
                     for c, (dtype, shape, squeezed) in enumerate(prep.specs)]
            lengths = []
            for c, s in enumerate(specs):
                if s.squeeze:
                    lengths.append(1)
                    continue
                fixed = sig.fixed_length(c) if sig is not None else -1
                if fixed >= 0:
                    lengths.append(int(fixed))
                else:
                    lengths.append(max(int(self.config.initial_max_length), prep.lengths[c], 1))
            structure = pb.Structure()
            structure.CopyFrom(sig.structure if sig is not None else prep.structure)
            capacity = self._columns.initial_capacity(specs, lengths, at_least=self.capacity,
                                                      at_most=self.max_size + self._spare)
            self._columns.learn(specs, lengths, structure, capacity)
            self._slots.set_num_columns(len(specs))
            self._grow_slots(capacity)
        finally:
            self._end_exclusive()

    def _next_capacity(self) -> int:
        """Slots after a growth: doubling up to max_size + spare, then spare more (leases pin deleted slots)."""
        full = self.max_size + self._spare
        if self.capacity < full:
            return min(full, 2 * self.capacity)
        return self.capacity + max(self._spare, 16)

    def _regrow(self, capacity: int, lengths: list[int] | None) -> None:
        """Move to a new segment with more slots and/or longer slots, items kept (lock held)."""
        self._begin_exclusive()
        try:
            if not self._columns.regrow(capacity, lengths, self._slots.rows_in_use()):
                return
            self._grow_slots(self._columns.layout.capacity)
        finally:
            self._end_exclusive()

    def _grow_slots(self, capacity: int) -> None:
        if capacity > self.capacity:
            self._slots.grow(capacity)
            self._sampler.resize(capacity)
            self._remover.resize(capacity)

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> TableSnapshot:
        """Every piece of state as numpy arrays plus JSON-serialisable scalars (items in insertion order).

        See ``gear_server.table_snapshot.capture`` for the arrays; restoring puts every
        item back in its slot, so selection (which walks slots) repeats exactly.
        """
        with self._lock:
            self._check_open()
            scalars = {
                "name": self.name, "seq": self._seq, "rate_limiter": self._rate_limiter.state(),
                "num_deleted_episodes": self._slots.num_deleted_episodes,
                "num_unique_samples": self._num_unique_samples, "table_worker_time_s": self._worker_time_s,
                "rng": jsonable(self._rng.bit_generator.state),
            }
            return capture(self._slots, self._columns, self._side, {"sampler": self._sampler, "remover": self._remover},
                           scalars)

    def restore(self, snapshot: TableSnapshot) -> None:
        """Load a snapshot into this (empty, unleased) table; it then behaves as the snapshotted one."""
        plan = RestorePlan(snapshot, self.name, self.max_size,
                           self._signature.structure if self._signature is not None else None)
        s = snapshot.scalars
        with self._lock:
            self._check_open()
            self._begin_exclusive()
            try:
                if not self._slots.idle():
                    raise ValueError(f"table '{self.name}': restore needs an empty table without leases")
                capacity = plan.capacity(max(self.capacity, plan.num_items + self._spare))
                self._sampler = make_selector(self.config.sampler, capacity)
                self._remover = make_selector(self.config.remover, capacity)
                self._slots = SlotBook(capacity, len(plan.specs))
                if plan.structure is not None:
                    self._columns.structure = plan.structure
                if plan.specs:
                    self._columns.learn(plan.specs, plan.max_lengths, self._columns.structure, capacity)
                self._side = SideStore()
                plan.load(self._slots, self._columns, self._side, {"sampler": self._sampler, "remover": self._remover})
                self._seq = int(s["seq"])
                self._rate_limiter.restore(s["rate_limiter"])
                self._num_unique_samples = int(s["num_unique_samples"])
                self._worker_time_s = float(s.get("table_worker_time_s", 0.0))
                rng_state = s.get("rng")
                if rng_state and rng_state.get("bit_generator") == self._rng.bit_generator.state["bit_generator"]:
                    self._rng.bit_generator.state = rng_state
            finally:
                self._end_exclusive()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wake every waiter with TableClosedError and unlink the segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._rate_limiter.cancel()
            self._cond.notify_all()
            while self._copies_in_flight:
                self._cond.wait()
            self._columns.close()

    def __repr__(self) -> str:
        return f"Table(name={self.name!r}, size={len(self._slots)}, max_size={self.max_size})"
