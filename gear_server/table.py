"""A replay table: items in shared-memory slots, metadata arrays, Reverb semantics.

Each item occupies one slot of a segment laid out by ``gear_contract.layout``:
per column, ``capacity`` slots of up to ``max_length`` steps (per-slot,
per-column lengths kept in ``meta.length``). ``capacity = max_size + spare``: a
deleted item's slot is not reused while a reader holds a lease on it, and the
spare slots let inserts go on meanwhile (the table grows its capacity if even
they run out). The maximum length comes from the signature's leading (time)
dimension, else from ``TableConfig.initial_max_length`` or the first item, and
grows (doubling, items kept) when a longer item arrives.

A table without a signature reports none (``TableInfo.signature`` unset, as in
Reverb); it learns its column layout (structure, dtypes, step shapes) from the
first item and keeps it internal (``layout()``). While it holds items, an item
that breaks that layout is refused (ValueError naming the column): Reverb would
store it, gear keeps one layout per segment. Once it is empty again (``reset``,
or every item removed) and no lease or copy is outstanding, the next item may
differ: the table relearns its layout into a new segment (layout version + 1).

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
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_server.errors import CallCancelled, RateLimiterTimeout, TableClosedError
from gear_server.rate_limiter import RateLimiter, deadline_after
from gear_server.selectors import make_selector
from gear_server.storage import Segment, SegmentStore

# --------------------------------------------------------------------------- data types


@dataclass
class ItemToInsert:
    """One item as the service hands it to the table.

    ``columns[i]`` is leaf i of ``structure`` (depth-first): ``[T, *shape]``, or
    ``[*shape]`` when ``squeeze[i]``. A non-squeezed column may also be given as a
    sequence of arrays whose steps are concatenated (chunk slices), saving a copy.
    """

    key: int
    priority: float
    structure: pb.Structure
    columns: list[np.ndarray]
    squeeze: list[bool]
    episode_ids: frozenset[int] = frozenset()


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


@dataclass
class TableSnapshot:
    """Every piece of a table's state: arrays plus JSON-serialisable scalars."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


class ItemMetadata:
    """Per-slot arrays (read directly by the GPU selection kernels)."""

    FIELDS = ("key", "priority", "insert_seq", "update_seq", "times_sampled", "generation", "length", "valid",
              "leases")

    def __init__(self, capacity: int, num_columns: int):
        self.key = np.zeros(capacity, np.uint64)
        self.priority = np.zeros(capacity, np.float64)
        self.insert_seq = np.zeros(capacity, np.int64)
        self.update_seq = np.zeros(capacity, np.int64)
        self.times_sampled = np.zeros(capacity, np.int32)
        self.generation = np.zeros(capacity, np.uint64)
        self.length = np.zeros((capacity, num_columns), np.int32)
        self.valid = np.zeros(capacity, np.bool_)
        self.leases = np.zeros(capacity, np.int32)

    @property
    def capacity(self) -> int:
        return len(self.key)

    def resized(self, capacity: int) -> ItemMetadata:
        """A copy with room for ``capacity`` slots (new slots zeroed)."""
        out = ItemMetadata(capacity, self.length.shape[1])
        n = min(capacity, self.capacity)
        for name in self.FIELDS:
            getattr(out, name)[:n] = getattr(self, name)[:n]
        return out


@dataclass(frozen=True)
class _ColumnSpec:
    name: str
    dtype: np.dtype
    step_shape: tuple[int, ...]
    squeeze: bool


@dataclass
class _PreparedItem:
    key: int
    priority: float
    pieces: list[list[np.ndarray]]  # per column, arrays of [t, *shape] (squeeze: one [1, *shape])
    lengths: list[int]
    specs: list[tuple[np.dtype, tuple[int, ...], bool]]  # per column (dtype, step shape, squeeze)
    episode_ids: tuple[int, ...]
    structure: pb.Structure


# --------------------------------------------------------------------------- helpers


def count_leaves(structure: pb.Structure) -> int:
    if structure.kind == pb.Structure.LEAF:
        return 1
    return sum(count_leaves(c) for c in structure.children)


def leaf_paths(structure: pb.Structure) -> list[str]:
    """Names of the leaves in depth-first order: dict keys / field names / indices joined by '/'."""
    out: list[str] = []

    def walk(node: pb.Structure, prefix: str) -> None:
        if node.kind == pb.Structure.LEAF:
            out.append(prefix)
            return
        for i, child in enumerate(node.children):
            if node.kind in (pb.Structure.DICT, pb.Structure.NAMEDTUPLE) and i < len(node.keys):
                part = node.keys[i]
            else:
                part = str(i)
            walk(child, f"{prefix}/{part}" if prefix else part)

    walk(structure, "")
    return [p or f"leaf{i}" for i, p in enumerate(out)]


def check_priority(priority: float, what: str = "priority") -> float:
    """A valid priority as float: finite and >= 0 (ValueError otherwise)."""
    try:
        value = float(priority)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a number, got {priority!r}") from e
    if math.isnan(value):
        raise ValueError(f"{what} is NaN")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    if math.isinf(value):
        raise ValueError(f"{what} must be finite, got {value}")
    return value + 0.0  # -0.0 -> 0.0


def _shape_matches(shape: tuple[int, ...], spec: Sequence[int]) -> bool:
    return len(shape) == len(spec) and all(s < 0 or s == d for d, s in zip(shape, spec, strict=True))


def _structure_difference(got: pb.Structure, want: pb.Structure) -> str:
    """The first column where an item's structure departs from the table's, in words."""
    got_paths, want_paths = leaf_paths(got), leaf_paths(want)
    for c, (g, w) in enumerate(zip(got_paths, want_paths, strict=False)):
        if g != w:
            return f"column '{g}' (#{c}) is where the table has column '{w}'"
    if len(got_paths) > len(want_paths):
        c = len(want_paths)
        return f"column '{got_paths[c]}' (#{c}) is not in the table's structure"
    if len(got_paths) < len(want_paths):
        c = len(got_paths)
        return f"the item lacks the table's column '{want_paths[c]}' (#{c})"
    return "same columns, but nested in different containers (dict/list/tuple/namedtuple)"


def _fmt_spec(spec: Sequence[int]) -> str:
    return "[" + ", ".join("?" if s < 0 else str(s) for s in spec) + "]"


def _gather(views: list[np.ndarray], specs: list[_ColumnSpec], slots: np.ndarray, lengths: np.ndarray
            ) -> list[np.ndarray]:
    """Per column, the slots' steps concatenated (one copy per column)."""
    out = []
    n = len(slots)
    for c, spec in enumerate(specs):
        view = views[c]
        if spec.squeeze:
            out.append(view[slots, 0])
            continue
        lens = lengths[:, c]
        first = int(lens[0]) if n else 0
        if n and np.all(lens == first):
            out.append(view[slots, :first].reshape(n * first, *spec.step_shape))
            continue
        buf = np.empty((int(lens.sum()), *spec.step_shape), spec.dtype)
        t = 0
        for s, ln in zip(slots.tolist(), lens.tolist(), strict=True):
            buf[t:t + ln] = view[s, :ln]
            t += ln
        out.append(buf)
    return out


def _jsonable(value: Any) -> Any:
    """numpy scalars inside nested dicts/lists -> Python scalars (for JSON)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _default_spare(max_size: int) -> int:
    return int(max(16, min(max_size // 8, 4096)))


# --------------------------------------------------------------------------- the table


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
        self._store = store
        self._spare = int(spare_slots) if spare_slots is not None else _default_spare(self.max_size)
        if self._spare < 1:
            raise ValueError("spare_slots must be >= 1")

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # copies in flight / exclusive operations
        self._rate_limiter = RateLimiter(config.rate_limiter, self._lock)
        self._rng = np.random.default_rng(seed)

        # Signature (optional) and the structure items must have.
        self._signature: pb.Signature | None = None
        self._structure: pb.Structure | None = None
        self._sig_leaves: list[tuple[np.dtype, tuple[int, ...], str]] | None = None
        if config.HasField("signature"):
            self._set_signature(config.signature)

        capacity = self.max_size + self._spare
        self._sampler = make_selector(config.sampler, capacity)
        self._remover = make_selector(config.remover, capacity)
        self._init_slots(capacity, num_columns=len(self._sig_leaves) if self._sig_leaves else 0)

        # Layout (None until the first item fixes it).
        self._specs: list[_ColumnSpec] | None = None
        self._spec_keys: list[tuple] = []
        self._layout: TableLayout | None = None
        self._segment: Segment | None = None
        self._views: list[np.ndarray] = []
        self._layout_version = -1
        self._layout_epoch = 0  # bumped whenever the specs are (re)fixed

        self._seq = 0  # orders inserts and priority updates
        self._episode_refs: dict[int, int] = {}
        self._num_deleted_episodes = 0
        self._num_unique_samples = 0
        self._worker_time_s = 0.0
        self._leases: dict[int, np.ndarray] = {}
        self._lease_ids = itertools.count(1)
        self._copies_in_flight = 0
        self._exclusive = False
        self._closed = False

    # ------------------------------------------------------------------ setup
    def _set_signature(self, signature: pb.Signature) -> None:
        n = count_leaves(signature.structure)
        if n != len(signature.leaves):
            raise ValueError(f"table '{self.name}': signature structure has {n} leaves but {len(signature.leaves)} "
                             "specs")
        if n == 0:
            raise ValueError(f"table '{self.name}': signature has no leaves")
        names = leaf_paths(signature.structure)
        leaves = []
        for i, leaf in enumerate(signature.leaves):
            try:
                dtype = np.dtype(leaf.dtype)
            except TypeError as e:
                raise ValueError(f"table '{self.name}': signature leaf {i} has bad dtype {leaf.dtype!r}") from e
            leaves.append((dtype, tuple(int(d) for d in leaf.shape), leaf.name or names[i]))
        self._signature = pb.Signature()
        self._signature.CopyFrom(signature)
        self._structure = signature.structure
        self._sig_leaves = leaves

    def _init_slots(self, capacity: int, num_columns: int) -> None:
        self.meta = ItemMetadata(capacity, num_columns)
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # a stack; slot 0 first
        self._zombies: set[int] = set()  # deleted but leased: reused once their leases end
        self._slot_episodes: list[tuple[int, ...]] = [()] * capacity
        self._key_to_slot: dict[int, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def capacity(self) -> int:
        return self.meta.capacity

    def __len__(self) -> int:
        return len(self._key_to_slot)

    def size(self) -> int:
        with self._lock:
            return len(self._key_to_slot)

    def layout(self) -> TableLayout | None:
        """The storage layout (None until the first item fixes it)."""
        with self._lock:
            return self._layout

    @property
    def closed(self) -> bool:
        return self._closed

    def can_sample(self, n: int = 1) -> bool:
        with self._lock:
            return len(self._key_to_slot) > 0 and self._rate_limiter.can_sample(n)

    def can_insert(self, n: int = 1) -> bool:
        with self._lock:
            return self._rate_limiter.can_insert(n)

    def wake_waiters(self) -> None:
        """Wake blocked inserts and samples so they re-check their ``abandoned`` callable (cancelled RPCs)."""
        with self._lock:
            self._rate_limiter.wake_all()

    def signature(self) -> pb.Signature | None:
        """The configured signature (None without one; a learned layout is not a signature)."""
        return self._signature

    def info(self) -> pb.TableInfo:
        with self._lock:
            info = pb.TableInfo(
                name=self.name, sampler_options=self._sampler.options, remover_options=self._remover.options,
                max_size=self.max_size, max_times_sampled=self.config.max_times_sampled,
                rate_limiter_info=self._rate_limiter.info(), current_size=len(self._key_to_slot),
                num_episodes=len(self._episode_refs), num_deleted_episodes=self._num_deleted_episodes,
                num_unique_samples=self._num_unique_samples, table_worker_time_ms=self._worker_time_s * 1e3,
            )
            if self._signature is not None:
                info.signature.CopyFrom(self._signature)
            return info

    # ------------------------------------------------------------------ validation
    def _prepare(self, item: ItemToInsert) -> _PreparedItem:
        """Checks that need no table state; normalises columns to lists of [t, *shape] pieces."""
        key = int(item.key)
        if not 0 <= key < 2**64:
            raise ValueError(f"item key {item.key} is not a uint64")
        priority = check_priority(item.priority, f"priority of item {key}")
        columns = item.columns
        squeeze = item.squeeze
        if len(columns) == 0:
            raise ValueError(f"item {key}: trajectory must not be empty (no columns)")
        if len(squeeze) != len(columns):
            raise ValueError(f"item {key}: {len(columns)} columns but {len(squeeze)} squeeze flags")
        n_leaves = count_leaves(item.structure)
        if n_leaves != len(columns):
            raise ValueError(f"item {key}: structure has {n_leaves} leaves but the item has {len(columns)} columns")

        def label(c: int) -> str:
            return f"item {key}: column '{leaf_paths(item.structure)[c]}' (#{c})"

        pieces, lengths, specs = [], [], []
        for c in range(len(columns)):
            col = columns[c]
            if isinstance(col, np.ndarray):
                parts = [col]
            elif isinstance(col, (list, tuple)) and col and all(isinstance(p, np.ndarray) for p in col):
                parts = list(col)
            else:
                raise ValueError(f"{label(c)} must be a numpy array or a list of them")
            first = parts[0]
            if first.dtype.hasobject:
                raise ValueError(f"{label(c)} has object dtype")
            if squeeze[c]:
                if len(parts) != 1:
                    raise ValueError(f"{label(c)} is squeezed and must be one array")
                specs.append((first.dtype, first.shape, True))
                pieces.append([first.reshape(1, *first.shape)])
                lengths.append(1)
                continue
            if first.ndim < 1:
                raise ValueError(f"{label(c)} has no time dimension (use squeeze for single steps)")
            step_shape = first.shape[1:]
            t = first.shape[0]
            for p in parts[1:]:
                if p.dtype != first.dtype or p.shape[1:] != step_shape:
                    raise ValueError(f"{label(c)}: its pieces disagree in dtype or step shape")
                t += p.shape[0]
            if t == 0:
                raise ValueError(f"{label(c)} is empty (length 0)")
            specs.append((first.dtype, step_shape, False))
            pieces.append(parts if len(parts) == 1 else [p for p in parts if p.shape[0]])
            lengths.append(int(t))
        episodes = tuple(sorted({int(e) for e in item.episode_ids})) if item.episode_ids else ()
        return _PreparedItem(key, priority, pieces, lengths, specs, episodes, item.structure)

    def _fits_layout(self, prep: _PreparedItem) -> bool:
        """Whether the item has the learned layout's structure, dtypes, step shapes and squeezes (lock held)."""
        return self._specs is None or (prep.specs == self._spec_keys and prep.structure == self._structure)

    def _can_relearn(self) -> bool:
        """Whether a signature-less table may take a new layout now: it holds no item, lease or copy (lock held)."""
        return (self._signature is None and self._specs is not None and not self._key_to_slot
                and not self._leases and not self._zombies and not self._copies_in_flight)

    def _needs_relearn(self, prep: _PreparedItem) -> bool:
        """True when the item breaks the learned layout and the table may relearn it; otherwise
        the item must fit (ValueError naming the column if not). Lock held."""
        if self._can_relearn() and not self._fits_layout(prep):
            return True
        self._validate(prep)
        return False

    def _validate(self, prep: _PreparedItem) -> None:
        """Checks against the signature and the learned layout (lock held)."""
        try:
            self._validate_fit(prep)
        except ValueError as e:
            if self._signature is None and self._specs is not None and not self._key_to_slot and self._leases:
                raise ValueError(f"{e} (the table is empty and relearns its layout from the next item once "
                                 f"its {len(self._leases)} outstanding lease(s) are released)") from None
            raise

    def _validate_fit(self, prep: _PreparedItem) -> None:
        if self._structure is not None and prep.structure != self._structure:
            raise ValueError(f"item {prep.key}: structure does not match the table's: "
                             f"{_structure_difference(prep.structure, self._structure)} (leaves "
                             f"{leaf_paths(prep.structure)} vs {leaf_paths(self._structure)})")
        if self._sig_leaves is not None:
            for c, ((dtype, step_shape, squeezed), length) in enumerate(zip(prep.specs, prep.lengths, strict=True)):
                want_dtype, want_shape, name = self._sig_leaves[c]
                full = step_shape if squeezed else (length, *step_shape)
                if dtype != want_dtype:
                    raise ValueError(f"item {prep.key}: column '{name}' (#{c}) has dtype {dtype} but the signature "
                                     f"says {want_dtype}")
                if not _shape_matches(full, want_shape):
                    raise ValueError(f"item {prep.key}: column '{name}' (#{c}) has shape {list(full)} but the "
                                     f"signature says {_fmt_spec(want_shape)}")
        if self._specs is not None and prep.specs != self._spec_keys:
            for c, ((dtype, step_shape, squeezed), fixed) in enumerate(zip(prep.specs, self._specs, strict=True)):
                label = f"item {prep.key}: column '{fixed.name}' (#{c})"
                if squeezed != fixed.squeeze:
                    raise ValueError(f"{label} is {'' if squeezed else 'not '}squeezed, unlike the table's items")
                if dtype != fixed.dtype:
                    raise ValueError(f"{label} has dtype {dtype} but the table holds {fixed.dtype}")
                if step_shape != fixed.step_shape:
                    raise ValueError(f"{label} has step shape {list(step_shape)} but the table holds "
                                     f"{list(fixed.step_shape)}")

    # ------------------------------------------------------------------ insert
    def insert(self, item: ItemToInsert, timeout: float | None = None, abandoned=None) -> None:
        """Insert (or, for an existing key, update the priority of) one item.

        Blocks while the rate limiter forbids the insert; RateLimiterTimeout after
        ``timeout`` seconds (None: wait forever). ValueError for a bad item, which
        leaves the table unchanged.
        """
        deadline = deadline_after(timeout)
        prep = self._prepare(item)
        with self._lock:
            self._check_open()
            relearn = self._needs_relearn(prep)
            if prep.key in self._key_to_slot:
                self._update_existing(prep.key, prep.priority)
                return
            epoch = self._layout_epoch
            self._rate_limiter.await_insert(deadline, abandoned)
            try:
                while True:
                    self._check_open()
                    if epoch != self._layout_epoch:
                        epoch = self._layout_epoch
                        relearn = self._needs_relearn(prep)
                    if prep.key in self._key_to_slot:
                        self._update_existing(prep.key, prep.priority)
                        self._rate_limiter.insert_abandoned()
                        return
                    if self._exclusive:
                        self._cond.wait()
                        continue
                    if self._specs is None or relearn:
                        if relearn and not self._can_relearn():  # items or leases arrived meanwhile
                            relearn = self._needs_relearn(prep)  # raises unless the item fits now
                            continue
                        self._fix_layout(prep)
                        continue
                    grown = self._grown_lengths(prep.lengths)
                    if grown is not None:
                        self._regrow(self.capacity, grown)
                        continue
                    if not self._free:
                        self._regrow(self.capacity + max(self._spare, 16), None)
                        continue
                    break
                slot = self._free.pop()
                self.meta.generation[slot] += np.uint64(1)
                self._copies_in_flight += 1
                views = self._views
            except BaseException:
                self._rate_limiter.insert_abandoned()
                raise
        committed = False
        try:
            for c, parts in enumerate(prep.pieces):
                view = views[c]
                t = 0
                for p in parts:
                    n = p.shape[0]
                    view[slot, t:t + n] = p
                    t += n
            with self._lock:
                self._copy_done()
                committed = True
                self._commit(slot, prep)
        except BaseException:
            with self._lock:
                if not committed:
                    self._copy_done()
                    self._free.append(slot)
                    self._rate_limiter.insert_abandoned()
            raise

    def _commit(self, slot: int, prep: _PreparedItem) -> None:
        t0 = time.perf_counter()
        if self._closed:
            self._free.append(slot)
            self._rate_limiter.insert_abandoned()
            raise TableClosedError(f"table '{self.name}' closed during the insert")
        if prep.key in self._key_to_slot:  # another insert of this key won the race
            self._free.append(slot)
            self._update_existing(prep.key, prep.priority)
            self._rate_limiter.insert_abandoned()
            return
        self._seq += 1
        seq = self._seq
        m = self.meta
        m.key[slot] = prep.key
        m.priority[slot] = prep.priority
        m.insert_seq[slot] = seq
        m.update_seq[slot] = seq
        m.times_sampled[slot] = 0
        m.length[slot] = prep.lengths
        m.valid[slot] = True
        self._key_to_slot[prep.key] = slot
        self._sampler.insert(slot, prep.priority, seq)
        self._remover.insert(slot, prep.priority, seq)
        self._slot_episodes[slot] = prep.episode_ids
        for e in prep.episode_ids:
            self._episode_refs[e] = self._episode_refs.get(e, 0) + 1
        if len(self._key_to_slot) > self.max_size:
            victim = self._remover.pick_one(self._rng)
            self._delete_slot(victim)
        self._rate_limiter.insert_committed()
        self._worker_time_s += time.perf_counter() - t0

    def _update_existing(self, key: int, priority: float) -> None:
        slot = self._key_to_slot[key]
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

    # ------------------------------------------------------------------ delete
    def _delete_slot(self, slot: int) -> None:
        """Remove the item in ``slot`` (lock held); the slot is freed once unleased."""
        m = self.meta
        key = int(m.key[slot])
        m.valid[slot] = False
        del self._key_to_slot[key]
        self._sampler.delete(slot)
        self._remover.delete(slot)
        for e in self._slot_episodes[slot]:
            refs = self._episode_refs[e] - 1
            if refs:
                self._episode_refs[e] = refs
            else:
                del self._episode_refs[e]
                self._num_deleted_episodes += 1
        self._slot_episodes[slot] = ()
        if m.leases[slot] > 0:
            self._zombies.add(slot)
        else:
            self._free.append(slot)
        self._rate_limiter.deleted()

    # ------------------------------------------------------------------ sample
    def sample(self, num_samples: int, timeout: float | None = None, abandoned=None) -> Selection:
        """Pick ``num_samples`` items, each as if sampled alone; lease their slots.

        Each pick passes the rate limiter (blocking between picks as needed),
        increments times_sampled (reported including this pick), reports the table
        size before any deletion it causes, and deletes the item when it reaches
        max_times_sampled. RateLimiterTimeout if not even one pick was allowed
        before ``timeout``; if the timeout passes after some picks, those are
        returned (fewer than asked, as Reverb's flexible batches).
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
                k = rl.samples_allowed_now(n - taken) if self._key_to_slot else 0
                if k == 0:
                    try:
                        rl.await_sample(deadline, ready=self._has_items, abandoned=abandoned)
                    except RateLimiterTimeout:
                        if taken:
                            break
                        raise
                    except (TableClosedError, CallCancelled):
                        self._release_chunks(chunks)
                        raise
                    k = 1
                t0 = time.perf_counter()
                chunk = self._pick(k)
                chunks.append(chunk)
                got = len(chunk[0])
                taken += got
                rl.sampled(got)
                self._worker_time_s += time.perf_counter() - t0
            lease_id = next(self._lease_ids)
            if len(chunks) == 1:
                slots, keys, probs, sizes, priorities, times = chunks[0]
            else:
                slots, keys, probs, sizes, priorities, times = (np.concatenate(parts) for parts in zip(*chunks, strict=True))
            self._leases[lease_id] = slots
            m = self.meta
            return Selection(
                slots=slots, generations=m.generation[slots], lengths=m.length[slots], keys=keys,
                probabilities=probs, table_sizes=sizes, priorities=priorities, times_sampled=times,
                lease_id=lease_id, layout_version=self._layout_version,
            )

    def _has_items(self) -> bool:
        return bool(self._key_to_slot)

    def _pick(self, k: int) -> tuple:
        """Up to k picks that see the same table (lock held); stops after a pick that deletes its item."""
        slots, probs = self._sampler.sample(k, self._rng)
        m = self.meta
        # occurrence index of each pick among earlier picks of the same slot (None: all distinct)
        occ = None
        if k > 1:
            order = np.argsort(slots, kind="stable")
            s = slots[order]
            same = s[1:] == s[:-1]
            if same.any():
                starts = np.ones(k, np.bool_)
                starts[1:] = ~same
                group_start = np.maximum.accumulate(np.where(starts, np.arange(k), 0))
                occ = np.empty(k, np.int64)
                occ[order] = np.arange(k) - group_start
        before = m.times_sampled[slots]
        times = before + 1 if occ is None else (before + occ + 1).astype(np.int32)
        mts = self.max_times_sampled
        if mts:
            hits = np.flatnonzero(times >= mts)
            if hits.size:
                cut = int(hits[0]) + 1
                slots, probs, times, before = slots[:cut], probs[:cut], times[:cut], before[:cut]
                occ = None if occ is None else occ[:cut]
        size = len(self._key_to_slot)
        first = before == 0 if occ is None else (before == 0) & (occ == 0)
        self._num_unique_samples += int(np.count_nonzero(first))
        if occ is None:
            m.times_sampled[slots] += 1
            m.leases[slots] += 1
        else:
            distinct, counts = np.unique(slots, return_counts=True)  # faster than np.add.at
            counts = counts.astype(np.int32)
            m.times_sampled[distinct] += counts
            m.leases[distinct] += counts
        chunk = (slots, m.key[slots], probs, np.full(len(slots), size, np.int64), m.priority[slots], times)
        if mts and times[-1] >= mts:
            self._delete_slot(int(slots[-1]))
        return chunk

    def _release_chunks(self, chunks: list[tuple]) -> None:
        for c in chunks:
            self._release_slots(c[0])

    # ------------------------------------------------------------------ read / release
    def read(self, selection: Selection) -> list[np.ndarray]:
        """Copy the selected (leased) items' bytes: per column, the items' steps concatenated.

        Non-squeezed columns give ``[sum(lengths), *shape]``; squeezed ones ``[n, *shape]``.
        """
        views, specs = self._leased_views(selection)
        return _gather(views, specs, selection.slots, selection.lengths)

    def slot_views(self, selection: Selection) -> list[list[np.ndarray]]:
        """Per column, one contiguous view per selected item of its steps in the segment (no copy).

        Valid while the selection's lease is held (a leased slot is never rewritten);
        joining them (e.g. ``b"".join``) gives the same bytes as ``read``.
        """
        views, specs = self._leased_views(selection)
        slots = selection.slots.tolist()
        out = []
        for c, spec in enumerate(specs):
            view = views[c]
            if spec.squeeze:
                out.append([view[s, 0] for s in slots])
            else:
                out.append([view[s, :ln] for s, ln in zip(slots, selection.lengths[:, c].tolist(), strict=True)])
        return out

    def _leased_views(self, selection: Selection) -> tuple[list[np.ndarray], list[_ColumnSpec]]:
        """The column views and specs to read ``selection`` from, once its lease is confirmed held.

        Read outside the lock: leased slots are never rewritten, and each view holds an
        export of its mapping, so a segment replaced meanwhile (growth) stays mapped.
        """
        with self._lock:
            self._check_open()
            if selection.lease_id not in self._leases:
                raise ValueError(f"lease {selection.lease_id} is not held on table '{self.name}'")
            return self._views, self._specs

    def release(self, lease_id: int) -> None:
        """End a lease (unknown or already released ids are ignored)."""
        with self._lock:
            slots = self._leases.pop(int(lease_id), None)
            if slots is not None:
                self._release_slots(slots)

    def _release_slots(self, slots: np.ndarray) -> None:
        m = self.meta
        distinct, counts = np.unique(slots, return_counts=True)
        m.leases[distinct] -= counts.astype(np.int32)
        slots = distinct
        if self._zombies:
            for s in slots[m.leases[slots] == 0].tolist():
                if s in self._zombies:
                    self._zombies.remove(s)
                    self._free.append(s)
            if self._exclusive or self._copies_in_flight:
                self._cond.notify_all()

    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # ------------------------------------------------------------------ mutate / reset
    def mutate_priorities(self, updates: Mapping[int, float] | Iterable[tuple[int, float]] | None = None,
                          deletes: Iterable[int] | None = None) -> None:
        """Delete ``deletes``, then set priorities; unknown keys are ignored.

        ValueError (nothing changed) if any new priority is NaN, negative or infinite.
        """
        if updates is None:
            keys: list[int] = []
            prios = np.zeros(0)
        elif isinstance(updates, Mapping):
            keys = list(updates.keys())
            prios = np.fromiter(updates.values(), np.float64, len(keys))
        else:
            pairs = list(updates)
            keys = [k for k, _ in pairs]
            prios = np.array([float(p) for _, p in pairs], np.float64)
        bad = np.flatnonzero(~np.isfinite(prios) | (prios < 0))
        if bad.size:
            i = int(bad[0])
            check_priority(prios[i], f"new priority of key {keys[i]}")
        prios = prios + 0.0  # -0.0 -> 0.0
        delete_keys = list(deletes) if deletes is not None else []
        with self._lock:
            self._check_open()
            t0 = time.perf_counter()
            k2s = self._key_to_slot
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
                self._clear_items()
                self._rate_limiter.reset()
            finally:
                self._end_exclusive()

    def _clear_items(self) -> None:
        m = self.meta
        slots = np.flatnonzero(m.valid)
        m.valid[slots] = False
        leased = m.leases[slots] > 0
        self._zombies.update(slots[leased].tolist())
        self._free.extend(slots[~leased].tolist())
        self._key_to_slot.clear()
        self._sampler.clear()
        self._remover.clear()
        for s in slots.tolist():
            self._slot_episodes[s] = ()
        self._episode_refs.clear()
        self._num_deleted_episodes = 0
        self._num_unique_samples = 0

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
    def _fix_layout(self, prep: _PreparedItem) -> None:
        """Fix the column specs from the first item, or relearn them from an item that breaks the
        learned ones while the table holds nothing, and create the segment (lock held).

        A relearned layout gets a new segment (version + 1, the old one is released) and a new
        layout epoch, so waiting inserts re-validate and data-plane sessions fetch the new layout.
        """
        self._begin_exclusive()
        try:
            if self._specs is not None and not (self._can_relearn() and not self._fits_layout(prep)):
                return  # learned meanwhile (and the item fits, or it is refused by the caller)
            names = ([name for _, _, name in self._sig_leaves] if self._sig_leaves is not None
                     else leaf_paths(prep.structure))
            specs = [_ColumnSpec(names[c], dtype, tuple(shape), squeezed)
                     for c, (dtype, shape, squeezed) in enumerate(prep.specs)]
            lengths = []
            for c, s in enumerate(specs):
                if s.squeeze:
                    lengths.append(1)
                    continue
                fixed = self._sig_leaves[c][1][0] if self._sig_leaves is not None else -1
                if fixed >= 0:
                    lengths.append(int(fixed))
                else:
                    lengths.append(max(int(self.config.initial_max_length), prep.lengths[c], 1))
            structure = pb.Structure()
            structure.CopyFrom(self._signature.structure if self._signature is not None else prep.structure)
            # the segment first: if it cannot be made (e.g. ENOSPC), the table keeps its old layout
            self._build_segment(self.capacity, lengths, copy_from=None, specs=specs, structure=structure)
            self._set_specs(specs)
            self._structure = structure
            if self.meta.length.shape[1] != len(specs):
                meta = ItemMetadata(self.capacity, len(specs))
                meta.generation[:] = self.meta.generation  # (slot, generation) stays unique across layouts
                self.meta = meta
            self._layout_epoch += 1
        finally:
            self._end_exclusive()

    def _set_specs(self, specs: list[_ColumnSpec]) -> None:
        self._specs = specs
        self._spec_keys = [(s.dtype, s.step_shape, s.squeeze) for s in specs]

    def _grown_lengths(self, lengths: list[int]) -> list[int] | None:
        """New per-column max lengths if an item of ``lengths`` does not fit, else None."""
        current = self._max_lengths
        if all(ln <= cur for ln, cur in zip(lengths, current, strict=True)):
            return None
        return [cur if ln <= cur else max(ln, 2 * cur) for ln, cur in zip(lengths, current, strict=True)]

    def _build_segment(self, capacity: int, lengths: list[int], copy_from: tuple | None,
                       specs: list[_ColumnSpec] | None = None, structure: pb.Structure | None = None) -> None:
        """Create the next layout version's segment (``specs``/``structure``: the current ones unless
        given), copy ``copy_from``'s items into it and switch to it. On failure nothing changes."""
        specs = self._specs if specs is None else specs
        structure = self._structure if structure is None else structure
        version = self._layout_version + 1
        columns = [(s.name, s.dtype, s.step_shape, lengths[c], s.squeeze) for c, s in enumerate(specs)]
        path = self._store.segment_path(self.name, version)
        layout = TableLayout.build(self.name, path, capacity, columns, version=version, structure=structure)
        segment = self._store.create(self.name, version, layout.segment_size)
        try:
            views = [layout.column_view(segment.buffer, c) for c in range(len(columns))]
            if copy_from is not None:
                old_layout, old_views, old_segment = copy_from
                for c, (old_col, new_col) in enumerate(zip(old_layout.columns, layout.columns, strict=True)):
                    if old_col.slot_stride == new_col.slot_stride:  # same slots, more of them: one memcpy
                        nbytes = old_col.slot_stride * old_layout.capacity
                        dst = np.frombuffer(segment.buffer, np.uint8, nbytes, new_col.offset)
                        dst[:] = np.frombuffer(old_segment.buffer, np.uint8, nbytes, old_col.offset)
                    else:
                        views[c][: old_layout.capacity, : old_col.max_length] = old_views[c]
        except BaseException:
            self._store.release(segment)
            raise
        old_segment = self._segment
        self._layout, self._segment, self._views = layout, segment, views
        self._max_lengths = [c.max_length for c in layout.columns]
        self._layout_version = version
        if old_segment is not None:
            self._store.release(old_segment)

    def _regrow(self, capacity: int, lengths: list[int] | None) -> None:
        """Move to a new segment with more slots and/or longer slots, items kept (lock held)."""
        self._begin_exclusive()
        try:
            old_capacity = self.capacity
            if lengths is None:
                lengths = [c.max_length for c in self._layout.columns]
                if capacity <= old_capacity:
                    return
            else:
                current = [c.max_length for c in self._layout.columns]
                lengths = [max(a, b) for a, b in zip(lengths, current, strict=True)]
                if lengths == current and capacity <= old_capacity:
                    return
            capacity = max(capacity, old_capacity)
            old = (self._layout, self._views, self._segment)
            self._build_segment(capacity, lengths, copy_from=old)
            del old
            if capacity > old_capacity:
                self.meta = self.meta.resized(capacity)
                self._sampler.resize(capacity)
                self._remover.resize(capacity)
                self._slot_episodes.extend([()] * (capacity - old_capacity))
                self._free[:0] = range(capacity - 1, old_capacity - 1, -1)
        finally:
            self._end_exclusive()

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> TableSnapshot:
        """Every piece of state as numpy arrays plus JSON-serialisable scalars (items in insertion order).

        Arrays: keys, priorities, insert_seq, update_seq, times_sampled, lengths [n, C],
        slots (where each item lives), free_slots (the free-slot stack), column/<c> (the
        items' steps concatenated, as ``read``), episode_ids with episode_counts (per
        item), structure (serialised gear.v1.Structure), and sampler/<name>,
        remover/<name> (selector state, slots mapped to item indices). Restoring puts
        every item back in its slot, so selection (which walks slots) repeats exactly.
        """
        with self._lock:
            self._check_open()
            m = self.meta
            slots = np.flatnonzero(m.valid)
            slots = slots[np.argsort(m.insert_seq[slots], kind="stable")]
            n = len(slots)
            arrays: dict[str, np.ndarray] = {
                "keys": m.key[slots], "priorities": m.priority[slots], "insert_seq": m.insert_seq[slots],
                "update_seq": m.update_seq[slots], "times_sampled": m.times_sampled[slots],
                "lengths": m.length[slots], "slots": slots.astype(np.int64),
                # leased slots of deleted items are free once restored (no lease survives)
                "free_slots": np.array(sorted(self._zombies) + self._free, np.int64),
            }
            columns: list[dict[str, Any]] = []
            if self._specs is not None:
                for c, data in enumerate(_gather(self._views, self._specs, slots, m.length[slots])):
                    arrays[f"column/{c}"] = data
                for spec, col in zip(self._specs, self._layout.columns, strict=True):
                    columns.append({"name": spec.name, "dtype": spec.dtype.str, "shape": list(spec.step_shape),
                                    "squeeze": spec.squeeze, "max_length": col.max_length})
            episodes = [self._slot_episodes[s] for s in slots.tolist()]
            arrays["episode_counts"] = np.array([len(e) for e in episodes], np.int64)
            arrays["episode_ids"] = np.array([e for ep in episodes for e in ep], np.uint64)
            structure = self._structure.SerializeToString() if self._structure is not None else b""
            arrays["structure"] = np.frombuffer(structure, np.uint8).copy()
            index = np.full(self.capacity, -1, np.int64)
            index[slots] = np.arange(n)
            for role, selector in (("sampler", self._sampler), ("remover", self._remover)):
                for name, value in selector.snapshot().items():
                    arrays[f"{role}/{name}"] = index[value]
            scalars = {
                "name": self.name, "num_items": n, "capacity": self.capacity, "columns": columns, "has_structure": self._structure is not None,
                "seq": self._seq, "rate_limiter": self._rate_limiter.state(),
                "num_deleted_episodes": self._num_deleted_episodes, "num_unique_samples": self._num_unique_samples,
                "table_worker_time_s": self._worker_time_s, "rng": _jsonable(self._rng.bit_generator.state),
            }
            return TableSnapshot(arrays, scalars)

    def restore(self, snapshot: TableSnapshot) -> None:
        """Load a snapshot into this (empty, unleased) table; it then behaves as the snapshotted one."""
        a, s = snapshot.arrays, snapshot.scalars
        n = int(s["num_items"])
        if n > self.max_size:
            raise ValueError(f"table '{self.name}': snapshot holds {n} items, more than max_size {self.max_size}")
        specs = [_ColumnSpec(c["name"], np.dtype(c["dtype"]), tuple(c["shape"]), bool(c["squeeze"]))
                 for c in s["columns"]]
        max_lengths = [int(c["max_length"]) for c in s["columns"]]
        structure = None
        if s.get("has_structure"):
            structure = pb.Structure()
            structure.ParseFromString(np.asarray(a["structure"], np.uint8).tobytes())
        if n and not specs:
            raise ValueError(f"table '{self.name}': snapshot has items but no column layout")
        if self._signature is not None and structure is not None and structure != self._structure:
            raise ValueError(f"table '{self.name}': snapshot structure does not match the table's signature")
        lengths = np.asarray(a["lengths"], np.int32).reshape(n, len(specs))
        with self._lock:
            self._check_open()
            self._begin_exclusive()
            try:
                if self._key_to_slot or self._leases or self._zombies:
                    raise ValueError(f"table '{self.name}': restore needs an empty table without leases")
                slots = np.asarray(a["slots"], np.int64) if "slots" in a else np.arange(n, dtype=np.int64)
                capacity = max(self.capacity, n + self._spare, int(s.get("capacity", 0)),
                               int(slots.max()) + 1 if n else 0)
                self._sampler = make_selector(self.config.sampler, capacity)
                self._remover = make_selector(self.config.remover, capacity)
                self._init_slots(capacity, len(specs))
                self._episode_refs.clear()
                if structure is not None:
                    self._structure = structure
                if specs:
                    self._set_specs(specs)
                    self._build_segment(capacity, max_lengths, copy_from=None)
                    self._layout_epoch += 1
                if len(np.unique(slots)) != n:
                    raise ValueError(f"table '{self.name}': snapshot has duplicate slots")
                for c, spec in enumerate(specs):
                    data = a[f"column/{c}"]
                    view = self._views[c]
                    if spec.squeeze:
                        view[slots, 0] = data
                    elif n and np.all(lengths[:, c] == lengths[0, c]):
                        ln = int(lengths[0, c])
                        view[slots, :ln] = np.asarray(data).reshape(n, ln, *spec.step_shape)
                    else:
                        t = 0
                        for slot, ln in zip(slots.tolist(), lengths[:, c].tolist(), strict=True):
                            view[slot, :ln] = data[t:t + ln]
                            t += ln
                m = self.meta
                m.key[slots] = a["keys"]
                m.priority[slots] = a["priorities"]
                m.insert_seq[slots] = a["insert_seq"]
                m.update_seq[slots] = a["update_seq"]
                m.times_sampled[slots] = a["times_sampled"]
                m.length[slots] = lengths
                m.valid[slots] = True
                m.generation[slots] = 1
                self._key_to_slot = dict(zip(m.key[slots].tolist(), slots.tolist(), strict=True))
                if len(self._key_to_slot) != n:
                    raise ValueError(f"table '{self.name}': snapshot has duplicate keys")
                used = np.zeros(capacity, np.bool_)
                used[slots] = True
                free = np.asarray(a["free_slots"], np.int64) if "free_slots" in a else np.zeros(0, np.int64)
                free = free[(free < capacity)]
                free = free[~used[free]]
                used[free] = True
                # slots the snapshot does not mention (a larger table) go below the recorded stack
                self._free = np.flatnonzero(~used)[::-1].tolist() + free.tolist()
                counts = np.asarray(a["episode_counts"], np.int64).tolist()
                ids = np.asarray(a["episode_ids"], np.uint64).tolist()
                t = 0
                for slot, cnt in zip(slots.tolist(), counts, strict=True):
                    eps = tuple(ids[t:t + cnt])
                    t += cnt
                    self._slot_episodes[slot] = eps
                    for e in eps:
                        self._episode_refs[e] = self._episode_refs.get(e, 0) + 1
                for role, selector in (("sampler", self._sampler), ("remover", self._remover)):
                    state = {k[len(role) + 1:]: slots[np.asarray(v, np.int64)] for k, v in a.items()
                             if k.startswith(role + "/")}
                    selector.restore(slots, m.priority[slots], m.insert_seq[slots], m.update_seq[slots], state)
                self._seq = int(s["seq"])
                self._rate_limiter.restore(s["rate_limiter"])
                self._num_deleted_episodes = int(s["num_deleted_episodes"])
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
            segment, self._segment, self._views = self._segment, None, []
        if segment is not None:
            self._store.release(segment)

    def __repr__(self) -> str:
        return f"Table(name={self.name!r}, size={len(self._key_to_slot)}, max_size={self.max_size})"
