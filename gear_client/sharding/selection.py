"""Global selection over shards: how a batch is split, and the probabilities reported.

Every shard selects its own part with its own selector (its GPU kernels or CPU
structure); the client only decides how many items each shard picks and rewrites
the reported ``probability`` and ``table_size`` to the global ones:

* uniform: the batch is split multinomially by the shards' sizes, so every item
  of every shard is equally likely; probability 1 / global size.
* prioritized: split multinomially by each shard's priority mass (sum of
  priority ** exponent), so P(item) = p ** a / global mass; the reported
  probability is exactly that, with each sampled shard's mass as it was when it
  selected (derived from its answer: weight / local probability) and the others'
  masses as they reported them just before. Every mass 0: uniform, as one table.
* max/min heap: the whole batch comes from the shard whose head (highest /
  lowest priority) is best, which is the global head: exact for every pick that
  one table would take from its head too (e.g. batches that do not use the head
  up through max_times_sampled); after that, approximate.
* fifo/lifo: the shards have no common clock, so the batch is split by size and
  each shard gives its own oldest (newest) items: exact per shard, approximate
  globally. Reported probability 1.0 (as one table).
* a table whose picks remove their items (``max_times_sampled`` 1, e.g. a
  queue): no shard is asked for more items than it holds while the table holds
  the batch. Uniform, fifo and lifo split without replacement (multivariate
  hypergeometric by size); prioritized by mass, then capped at each shard's
  size (the excess moved to shards with room); heaps take the best heads first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.selectors import priority_weights

UNIFORM, PRIORITIZED, HEAP, FIFO, LIFO = "uniform", "prioritized", "heap", "fifo", "lifo"


@dataclass(frozen=True)
class Policy:
    """A table's sampler, as far as splitting a batch over shards needs it."""

    kind: str
    exponent: float = 0.0
    min_heap: bool = False
    consumes: bool = False  # max_times_sampled 1 (a queue): a pick removes its item

    @classmethod
    def of(cls, options: pb.SelectorOptions, max_times_sampled: int = 0) -> Policy:
        kind = options.WhichOneof("distribution")
        consumes = int(max_times_sampled) == 1
        if kind == PRIORITIZED:
            return cls(kind, exponent=float(options.prioritized.priority_exponent), consumes=consumes)
        if kind == HEAP:
            return cls(kind, min_heap=bool(options.heap.min_heap), consumes=consumes)
        if kind not in (UNIFORM, FIFO, LIFO):
            raise ValueError(f"a sharded table needs a known sampler, got {kind!r}")
        return cls(kind, consumes=consumes)


@dataclass(frozen=True)
class ShardWeight:
    """One shard's state for a split (from its TableInfo)."""

    shard: int
    size: int
    mass: float = 0.0
    head: float | None = None  # heaps: the next pick's priority

    @classmethod
    def of(cls, shard: int, info: pb.TableInfo) -> ShardWeight:
        state = info.selection_state
        return cls(shard, int(info.current_size), float(state.priority_mass),
                   float(state.head_priority) if state.has_head else None)


def split(policy: Policy, weights: list[ShardWeight], n: int, rng: np.random.Generator) -> dict[int, int]:
    """How many of ``n`` items each shard picks (shard -> count > 0); {} when no shard has an item."""
    present = [w for w in weights if w.size > 0]
    if not present or n <= 0:
        return {}
    if policy.kind == HEAP:
        if policy.consumes:  # the best heads first, each shard's whole content at most
            present.sort(key=lambda w: ((-w.head if policy.min_heap else w.head)
                                        if w.head is not None else -math.inf, -w.shard), reverse=True)
            return _counts(present, _fill_in_order(np.array([w.size for w in present], np.int64), n))
        best = max(present, key=lambda w: ((-w.head if policy.min_heap else w.head)
                                           if w.head is not None else -math.inf, -w.shard))
        return {best.shard: n}
    sizes = np.array([w.size for w in present], np.int64)
    if policy.consumes and policy.kind != PRIORITIZED:
        return _counts(present, _without_replacement(sizes, n, rng))
    share = sizes.astype(np.float64)
    if policy.kind == PRIORITIZED:
        masses = np.array([w.mass for w in present], np.float64)
        total = masses.sum()
        if total > 0 and math.isfinite(total):
            share = masses
    counts = rng.multinomial(n, share / share.sum())
    if policy.consumes:
        counts = _within_sizes(counts, sizes, share, rng)
    return _counts(present, counts)


def _counts(present: list[ShardWeight], counts: np.ndarray) -> dict[int, int]:
    return {w.shard: int(c) for w, c in zip(present, counts.tolist(), strict=True) if c}


def _without_replacement(sizes: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Counts of ``n`` picks that each remove their item (a queue): n items of the union drawn without
    replacement (multivariate hypergeometric), so no shard is asked for more than it holds while the
    others hold enough (such a part would wait, holding the items the other parts removed). Past the
    total, every item is taken and the rest is split by size: those parts wait for new items, as one
    table would."""
    total = int(sizes.sum())
    if n <= total:
        return rng.multivariate_hypergeometric(sizes, n)
    return sizes + rng.multinomial(n - total, sizes / total)


def _fill_in_order(sizes: np.ndarray, n: int) -> np.ndarray:
    """``n`` picks from the shards in order, each up to its size; the rest on the first (it waits)."""
    counts = np.minimum(np.maximum(n - np.concatenate(([0], np.cumsum(sizes)[:-1])), 0), sizes)
    counts[0] += n - int(counts.sum())
    return counts


def _within_sizes(counts: np.ndarray, sizes: np.ndarray, share: np.ndarray, rng: np.random.Generator
                  ) -> np.ndarray:
    """Counts past a shard's size moved to shards with room, by their share (picks that remove their
    items: prioritized queues); what no shard has room for stays where it was drawn."""
    counts = counts.copy()
    for _ in range(len(counts)):
        excess = int(np.maximum(counts - sizes, 0).sum())
        room = np.maximum(sizes - counts, 0)
        if not excess or not room.any():
            break
        np.minimum(counts, sizes, out=counts)
        weights = np.where(room > 0, share, 0.0)
        if not weights.sum() > 0:
            weights = room.astype(np.float64)
        counts += rng.multinomial(excess, weights / weights.sum())
    return counts


MASS_SAMPLE = 16  # items a shard's mass is derived from (each gives it exactly, up to rounding)


def selection_mass(policy: Policy, priorities: np.ndarray, probabilities: np.ndarray) -> float | None:
    """A shard's priority mass when it selected (weight / its probability), None if its answer cannot tell."""
    priorities, probabilities = priorities[:MASS_SAMPLE], probabilities[:MASS_SAMPLE]
    w = priority_weights(priorities, policy.exponent)
    ok = (w > 0) & (probabilities > 0)
    ratios = np.sort(w[ok] / probabilities[ok])  # a median of at most 16, without np.median's overhead (per batch)
    m = len(ratios)
    if m == 0:
        return None
    return float(ratios[m // 2]) if m % 2 else float((ratios[m // 2 - 1] + ratios[m // 2]) / 2)


def globalise(policy: Policy, weights: dict[int, ShardWeight], parts: dict[int, tuple[np.ndarray, ...]],
              *, masses_from_answers: bool = True) -> tuple[int, list[np.ndarray]]:
    """Global (table_size, per-part probabilities) of parts shard -> (priorities, probabilities, table_sizes).

    Sampled shards count with their size and mass at selection; the others with
    what they reported before the split (``weights``). ``masses_from_answers``
    False: every mass as reported before the split (a group rank, whose slice of a
    shard's picks would give a median of other items than another rank's).
    """
    sizes = {s: w.size for s, w in weights.items()}
    masses = {s: w.mass for s, w in weights.items()}
    for s, (priorities, probabilities, table_sizes) in parts.items():
        if len(table_sizes):
            sizes[s] = int(table_sizes[0])
        if policy.kind == PRIORITIZED and masses_from_answers:
            mass = selection_mass(policy, priorities, probabilities)
            if mass is not None:
                masses[s] = mass
    global_size = int(sum(sizes.values()))
    total_mass = sum(masses.values())
    out = []
    for priorities, probabilities, _ in parts.values():
        if policy.kind == UNIFORM or (policy.kind == PRIORITIZED and not total_mass > 0):
            out.append(np.full(len(priorities), 1.0 / max(global_size, 1)))
        elif policy.kind == PRIORITIZED:
            out.append(priority_weights(priorities, policy.exponent) / total_mass)
        else:
            out.append(np.asarray(probabilities, np.float64))
    return global_size, out


def sum_table_infos(infos: list[pb.TableInfo]) -> pb.TableInfo:
    """One table's TableInfo over its shards: sizes, counters and times summed, options from the first."""
    out = pb.TableInfo()
    out.CopyFrom(infos[0])
    for info in infos[1:]:
        out.max_size += info.max_size
        out.current_size += info.current_size
        out.num_episodes += info.num_episodes
        out.num_deleted_episodes += info.num_deleted_episodes
        out.num_unique_samples += info.num_unique_samples
        out.table_worker_time_ms += info.table_worker_time_ms
        out.selection_state.priority_mass += info.selection_state.priority_mass
        rl, other = out.rate_limiter_info, info.rate_limiter_info
        rl.num_deletes += other.num_deletes  # the limiter's options stay the first shard's: they act per shard
        for mine, theirs in ((rl.insert_stats, other.insert_stats), (rl.sample_stats, other.sample_stats)):
            mine.completed += theirs.completed
            mine.limited += theirs.limited
            mine.completed_wait_time_s += theirs.completed_wait_time_s
            mine.pending_wait_time_s += theirs.pending_wait_time_s
    return out
