"""What one batch of sampler picks does to the items: Reverb's per-pick counting.

Reverb samples one item at a time; gear asks the sampler for ``k`` picks at
once and then accounts for them as if they had come one by one: each pick
counts towards ``times_sampled`` (reported including itself, repeats of a slot
in one batch counted in order), takes a lease on its slot, and the batch stops
after the first pick that reaches ``max_times_sampled`` (that item is deleted by
the caller, so later picks would not have seen it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gear_server.slots import ItemMetadata


@dataclass
class Picks:
    """The counted picks of one batch."""

    slots: np.ndarray
    chunk: tuple  # (slots, keys, probabilities, table_sizes, priorities, times_sampled)
    first_samples: int  # picks of items never sampled before
    deletes_last: bool  # the last pick reached max_times_sampled: its item goes


def count_picks(meta: ItemMetadata, slots: np.ndarray, probs: np.ndarray, max_times_sampled: int,
                table_size: int) -> Picks:
    """Count ``slots`` (picked in this order) as samples and leases in ``meta`` (table lock held)."""
    k = len(slots)
    m = meta
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
    mts = max_times_sampled
    if mts:
        hits = np.flatnonzero(times >= mts)
        if hits.size:
            cut = int(hits[0]) + 1
            slots, probs, times, before = slots[:cut], probs[:cut], times[:cut], before[:cut]
            occ = None if occ is None else occ[:cut]
    first = before == 0 if occ is None else (before == 0) & (occ == 0)
    if occ is None:
        m.times_sampled[slots] += 1
        m.leases[slots] += 1
    else:
        distinct, counts = np.unique(slots, return_counts=True)  # faster than np.add.at
        counts = counts.astype(np.int32)
        m.times_sampled[distinct] += counts
        m.leases[distinct] += counts
    chunk = (slots, m.key[slots], probs, np.full(len(slots), table_size, np.int64), m.priority[slots], times)
    return Picks(slots, chunk, int(np.count_nonzero(first)), bool(mts and times[-1] >= mts))
