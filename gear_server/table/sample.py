"""A table's sample path: picks counted as Reverb's one-by-one samples, leased, then read.

``sample`` picks under the rate limiter (blocking between picks as needed) and
leases the picked slots; a leased slot is never rewritten, so the items are read
(``read``, ``slot_views``, ``item_groups``) outside the lock until ``release``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from gear_server.errors import CallCancelled, NeedsInlinePlane, RateLimiterTimeout, SamplingStopped, TableClosedError
from gear_server.table.columns import gather
from gear_server.table.columns import slot_views as column_slot_views
from gear_server.table.core import Abandoned, TableCore
from gear_server.table.items import ColumnSpec
from gear_server.table.picks import Picks, count_picks, held_of
from gear_server.table.rate_limiter import deadline_after
from gear_server.table.read_groups import ItemGroup, group_items
from gear_server.table.side_store import SideItem


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


def sample(core: TableCore, num_samples: int, timeout: float | None = None, abandoned: Abandoned = None, *,
           by_reference: bool = False, rng: np.random.Generator | None = None) -> Selection:
    """Pick ``num_samples`` items, each as if sampled alone, and lease their slots (``Table.sample``)."""
    n = int(num_samples)
    if n < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    deadline = deadline_after(timeout)
    batches: list[Picks] = []
    taken = 0
    rl = core.rate_limiter

    def has_items() -> bool:
        return bool(core.slots.key_to_slot)

    with core.lock:
        core.check_open_locked()
        while taken < n:
            k = rl.samples_allowed_now(n - taken) if core.slots.key_to_slot else 0
            if k == 0:
                try:
                    rl.await_sample(deadline, ready=has_items, abandoned=abandoned)
                except (RateLimiterTimeout, SamplingStopped):  # what was taken is handed over
                    if taken:
                        break
                    raise
                except (TableClosedError, CallCancelled):
                    for picks in batches:
                        core.unlease_locked(picks.held)
                    raise
                k = 1
            if by_reference and core.side:
                if taken:
                    break
                raise NeedsInlinePlane(f"table '{core.name}' holds items of {_layouts_held_locked(core)} layouts "
                                       "(structures, dtypes or step shapes); they are read inline")
            t0 = time.perf_counter()
            picks = _pick_locked(core, k, core.rng if rng is None else rng)
            batches.append(picks)
            got = len(picks.slots)
            taken += got
            rl.sampled(got)
            core.add_worker_time_locked(t0)
        if len(batches) == 1:
            slots, keys, probs, sizes, priorities, times, generations = batches[0].chunk
            held = batches[0].held
        else:
            slots, keys, probs, sizes, priorities, times, generations = (
                np.concatenate(parts) for parts in zip(*(p.chunk for p in batches), strict=True))
            held = held_of(slots)
        lease_id = core.slots.lease(held)
        return Selection(
            slots=slots, generations=generations, lengths=core.meta.length.take(slots, axis=0), keys=keys,
            probabilities=probs, table_sizes=sizes, priorities=priorities, times_sampled=times,
            lease_id=lease_id, layout_version=core.columns.version,
        )


def _layouts_held_locked(core: TableCore) -> int:
    """How many layouts the table's items have. The caller holds the lock."""
    return core.side.layouts() + (len(core.side) < len(core.slots))


def _pick_locked(core: TableCore, k: int, rng: np.random.Generator) -> Picks:
    """Up to k picks that see the same table; stops after a pick that deletes its item.

    The caller holds the lock.
    """
    slots, probs, repeats = core.sampler.sample_with_repeats(k, rng)
    picks = count_picks(core.meta, slots, probs, core.max_times_sampled, len(core.slots), repeats)
    core.count_unique_samples_locked(picks.first_samples)
    if picks.deletes_last:
        core.delete_slot_locked(int(picks.slots[-1]))
    return picks


# ---------------------------------------------------------------------- reading leased items
def read(core: TableCore, selection: Selection) -> list[np.ndarray]:
    """Copy the selected items' bytes: per column, the items' steps concatenated (``Table.read``)."""
    views, specs, side = _leased_views(core, selection)
    if side:
        raise ValueError("the selection holds items of other layouts than the table's columns: use item_groups")
    return gather(views, specs, selection.slots, selection.lengths)


def slot_views(core: TableCore, selection: Selection) -> list[list[np.ndarray]]:
    """Per column, one no-copy view per selected item of its steps (``Table.slot_views``)."""
    views, specs, side = _leased_views(core, selection)
    if side:
        raise ValueError("the selection holds items of other layouts than the table's columns: use item_groups")
    return column_slot_views(views, specs, selection.slots, selection.lengths)


def item_groups(core: TableCore, selection: Selection) -> list[ItemGroup]:
    """The selected items in runs that share one layout, in selection order (``Table.item_groups``)."""
    views, specs, side = _leased_views(core, selection)
    with core.lock:
        structure = core.columns.layout.structure
    return group_items(selection.slots, selection.lengths, views, specs, structure, side)


def _leased_views(core: TableCore, selection: Selection
                  ) -> tuple[list[np.ndarray], list[ColumnSpec], dict[int, SideItem]]:
    """The column views and specs to read ``selection`` from, once its lease is confirmed held,
    and the selected side items by slot.

    Read outside the lock: leased slots are never rewritten, and each view holds an
    export of its mapping, so a segment replaced meanwhile (growth) stays mapped.
    """
    with core.lock:
        core.check_open_locked()
        if selection.lease_id not in core.slots.leases:
            raise ValueError(f"lease {selection.lease_id} is not held on table '{core.name}'")
        side = core.side.items_among(selection.slots.tolist()) if core.side else {}
        return core.columns.views, core.columns.specs, side


def split_lease(core: TableCore, lease_id: int, start: int, stop: int) -> int:
    """Move the picks [start, stop) of a lease (in pick order) to a new lease; returns its id.

    The slots stay held throughout (the two leases together hold what the one did);
    the old lease ends when nothing is left in it. KeyError if it is not held.
    """
    with core.lock:
        held = core.slots.leases.get(int(lease_id))
        if held is None:
            raise KeyError(f"lease {lease_id} is not held on table '{core.name}'")
        picks = held.slots
        if not 0 <= start < stop <= len(picks):
            raise ValueError(f"picks [{start}, {stop}) are not in lease {lease_id} of {len(picks)} picks")
        rest = np.concatenate((picks[:start], picks[stop:]))
        if len(rest):
            core.slots.leases[int(lease_id)] = held_of(rest)
        else:
            del core.slots.leases[int(lease_id)]
        return core.slots.lease(held_of(picks[start:stop]))


def release(core: TableCore, lease_id: int) -> None:
    """End a lease (unknown or already released ids are ignored)."""
    with core.lock:
        held = core.slots.leases.pop(int(lease_id), None)
        if held is not None:
            core.unlease_locked(held)
