"""What one batch of sampler picks does to the items: Reverb's per-pick counting.

Reverb samples one item at a time; gear asks the sampler for ``k`` picks at
once and then accounts for them as if they had come one by one: each pick
counts towards ``times_sampled`` (reported including itself, repeats of a slot
in one batch counted in order), takes a lease on its slot, and the batch stops
after the first pick that reaches ``max_times_sampled`` (that item is deleted by
the caller, so later picks would not have seen it).

Every pick is counted as if its slot were picked once (a few numpy calls over
the batch); the repeats, a small part of a batch, are then corrected on their
own. Which picks repeat a slot comes from the sampler when it knows (the
prioritized one finds them without a sort), else from one stable sort here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gear_server.table.slots import ONE_LEASE, ONE_SAMPLE, Held, ItemMetadata, sample_counts

NO_REPEATS = np.empty(0, np.int64)


@dataclass
class Picks:
    """The counted picks of one batch."""

    slots: np.ndarray
    chunk: tuple  # (slots, keys, probabilities, table_sizes, priorities, times_sampled, generations)
    first_samples: int  # picks of items never sampled before
    deletes_last: bool  # the last pick reached max_times_sampled: its item goes
    held: Held  # what the lease on these picks holds


def run_members(values: np.ndarray) -> np.ndarray | None:
    """Which entries of sorted ``values`` equal a neighbour (the members of runs of two or more); None if none."""
    same = values[1:] == values[:-1]
    if not same.any():
        return None
    member = np.zeros(len(values), np.bool_)
    member[1:] = same
    member[:-1] |= same
    return member


def find_repeats(slots: np.ndarray) -> np.ndarray:
    """The positions of the picks whose slot is picked more than once, grouped by slot, ascending in a group."""
    if len(slots) < 2:
        return NO_REPEATS
    order = np.argsort(slots, kind="stable")
    member = run_members(slots[order])
    return NO_REPEATS if member is None else order[member]


def held_of(slots: np.ndarray, repeats: np.ndarray | None = None) -> Held:
    """What a lease on ``slots`` holds (``repeats``: as ``find_repeats`` gives them, found when None)."""
    repeats = find_repeats(slots) if repeats is None else repeats
    if not len(repeats):
        return Held(slots, NO_REPEATS, NO_REPEATS)
    group_slots, _, counts, _ = _repeat_groups(slots, repeats)
    return Held(slots, group_slots, counts - 1)


def _repeat_groups(slots: np.ndarray, repeats: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per slot picked more than once: (slot, where its repeats start in ``repeats``, how many picks), and
    per repeat its occurrence among its slot's picks (0 for the first)."""
    repeated = slots.take(repeats)
    starts = np.empty(len(repeated), np.bool_)  # a group's first repeat (numpy calls, no Python-level helpers)
    starts[0] = True
    np.not_equal(repeated[1:], repeated[:-1], out=starts[1:])
    firsts = np.flatnonzero(starts)
    ends = np.empty_like(firsts)
    ends[:-1] = firsts[1:]
    ends[-1] = len(repeated)
    counts = ends - firsts
    return repeated.take(firsts), firsts, counts, np.arange(len(repeated)) - np.repeat(firsts, counts)


def count_picks(meta: ItemMetadata, slots: np.ndarray, probs: np.ndarray, max_times_sampled: int,
                table_size: int, repeats: np.ndarray | None = None) -> Picks:
    """Count ``slots`` (picked in this order) as samples and leases in ``meta`` (the table calls it under
    its lock, as it does every part).

    ``repeats``: the positions of picks of a slot picked more than once, as ``find_repeats`` gives
    them, when the sampler knows them (found here when None).
    """
    m = meta
    if repeats is None:
        repeats = find_repeats(slots)
    records = m.hot.take(slots)  # one cache line per pick for every field read here
    before = records["times_sampled"]
    # each pick's slot sampled and leased once more, both written back in one pass (``m.counts``)
    pairs = sample_counts(records) + (ONE_SAMPLE + ONE_LEASE)
    times = pairs.view("<i4")[::2]  # the low halves: what each pick reports (a view: changes go into pairs)
    if len(repeats):  # a repeat counts the earlier picks of its slot in this batch
        group_slots, firsts, counts, occ = _repeat_groups(slots, repeats)
        times[repeats] += occ.astype(np.int32)
    mts = max_times_sampled
    if mts:
        hits = np.flatnonzero(times >= mts)
        if hits.size and hits[0] + 1 < len(slots):  # later picks would not have seen the deleted item
            cut = int(hits[0]) + 1
            slots, probs, times, before, records = slots[:cut], probs[:cut], times[:cut], before[:cut], records[:cut]
            pairs = pairs[:cut]
            repeats = find_repeats(slots) if len(repeats) else NO_REPEATS
            if len(repeats):
                group_slots, firsts, counts, occ = _repeat_groups(slots, repeats)
    first = len(slots) - int(np.count_nonzero(before))
    m.counts[slots] = pairs  # times right for slots picked once; leases + 1 once per distinct slot
    if len(repeats):
        before_repeats = before.take(repeats)
        first -= int(np.count_nonzero((before_repeats == 0) & (occ > 0)))  # only a slot's first pick is
        m.times_sampled[group_slots] = before_repeats.take(firsts) + counts.astype(np.int32)
        held = Held(slots, group_slots, counts - 1)
        m.leases[group_slots] += held.extra.astype(np.int32)
    else:
        held = Held(slots, NO_REPEATS, NO_REPEATS)
    chunk = (slots, records["key"], probs, np.full(len(slots), table_size, np.int64), records["priority"], times,
             records["generation"])
    return Picks(slots, chunk, first, bool(mts and times[-1] >= mts), held)
