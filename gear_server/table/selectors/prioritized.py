"""Prioritized selection: P(item) = w / sum(w) with w = priority ** exponent.

Priority 0 has weight 0 even for exponent 0; when every weight is 0 the pick is
uniform (as Reverb). The weights live in a flat array cut into blocks of
``block`` slots (a power of two) with each block's running sums kept beside
them and a sum per block (a two-level sum tree): a priority change marks its
block, whose running sums are recomputed when next read (a batch of changes
costs its weights; the sums follow once, before the next pick).

A batch of n picks draws its n uniform targets already sorted (exponential
spacings: no sort), finds their blocks with one ``searchsorted`` over the
cumulative block sums (sorted keys walk it in order, several times faster
than random ones) and the slot inside each block by a vectorised binary search
over the block's running sums (log2(block) steps of a few numpy calls over the
n picks); a random permutation then puts the picks in the order they are
returned, which is as random as n independent draws. That is O(N / block) after changes plus
O(n log N) in a fixed, small number of numpy calls over the n picks (no
per-pick Python, no sort), with the picks that repeat a slot handed to the
caller (``sample_with_repeats``) so that counting them needs no sort either.
"""

from __future__ import annotations

import math

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.selectors import priority_weights
from gear_server.table.picks import NO_REPEATS, run_members
from gear_server.table.selectors.base import Selector
from gear_server.table.selectors.offload import WeightOffload
from gear_server.table.selectors.uniform import Uniform

STALE_SLOTS_MAX = 1 << 16  # updated slots whose block sums may wait for the next read


def block_size_for(capacity: int) -> int:
    """Block size (a power of two, 16..1024) balancing what a learner's step costs after it changed
    priorities: the cumulative block sums (O(capacity / block)) against the running sums of the blocks
    changed (O(block) a changed slot, several times a plain sum's cost per number in numpy)."""
    target = math.sqrt(max(capacity, 1) / 4096.0)
    return int(min(1024, max(16, 1 << max(0, round(math.log2(max(target, 1.0)))))))


class Prioritized(Selector):
    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None, *,
                 priority_exponent: float | None = None):
        if options is None:
            options = pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=priority_exponent or 0.0))
        super().__init__(capacity, options)
        self.exponent = float(options.prioritized.priority_exponent if priority_exponent is None else priority_exponent)
        if math.isnan(self.exponent) or self.exponent < 0:
            raise ValueError(f"priority_exponent must be >= 0, got {self.exponent}")
        self._members = Uniform(capacity)  # the tracked slots (size, and the all-zero fallback)
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.block = block_size_for(capacity)
        self._nblocks = -(-capacity // self.block)
        self._w = np.zeros(self._nblocks * self.block, np.float64)
        self._w2d = self._w.reshape(self._nblocks, self.block)
        self._run = np.zeros_like(self._w)  # each block's running sums of its weights (inclusive)
        self._run2d = self._run.reshape(self._nblocks, self.block)
        self._bsum = np.zeros(self._nblocks, np.float64)  # = the last running sum of each block
        self._cum0 = np.zeros(self._nblocks + 1, np.float64)  # 0, then the cumulative block sums
        self._cum_valid = False
        self._stale: list[np.ndarray] = []  # slots updated since their blocks' sums were (``_sums``)
        self._stale_count = 0
        self._offload = WeightOffload(self._w)  # GPU kernels / NumPy twin where they beat the CPU structure

    def __len__(self) -> int:
        return len(self._members)

    def weight(self, priority: float) -> float:
        if priority > 0:
            try:
                return math.pow(priority, self.exponent)
            except OverflowError:
                return math.inf
        return 0.0

    def resize(self, capacity: int) -> None:
        old = self._w[: self.capacity].copy()
        self._alloc(capacity)
        self._w[: len(old)] = old
        self._refresh(None)  # the fresh _alloc has no stale blocks
        self._members.resize(capacity)
        self.capacity = int(capacity)

    def _set(self, slot: int, priority: float) -> None:
        self._w[slot] = self.weight(priority)
        b = slot // self.block
        np.cumsum(self._w2d[b], out=self._run2d[b])
        self._bsum[b] = self._run2d[b, -1]
        self._cum_valid = False
        self._offload.touch(slot)

    def insert(self, slot: int, priority: float, seq: int) -> None:
        self._members.insert(slot, priority, seq)
        self._set(slot, priority)

    def update(self, slot: int, priority: float, seq: int) -> None:
        self._set(slot, priority)

    def update_many(self, slots: np.ndarray, priorities: np.ndarray, seqs: np.ndarray) -> None:
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            return
        self._w[slots] = priority_weights(priorities, self.exponent)
        self._stale.append(slots)  # block sums follow when next read: a mutate's latency is the weights only
        self._stale_count += len(slots)
        if self._stale_count > STALE_SLOTS_MAX:
            self._sums()
        self._cum_valid = False
        self._offload.touch_many(slots)

    def _sums(self) -> np.ndarray:
        """The block sums, those of blocks updated since recomputed first."""
        if self._stale:
            slots = self._stale[0] if len(self._stale) == 1 else np.concatenate(self._stale)
            self._stale, self._stale_count = [], 0
            changed = np.zeros(self._nblocks, np.bool_)  # the blocks, without a sort
            changed[np.right_shift(slots, self.block.bit_length() - 1)] = True
            blocks = np.flatnonzero(changed)
            self._refresh(blocks if 4 * len(blocks) < self._nblocks else None)
            self._cum_valid = False
        return self._bsum

    def _refresh(self, blocks: np.ndarray | None) -> None:
        """Recompute the running sums and sums of ``blocks`` (None: every block, in place: cheaper than
        gathering and scattering back a large part of them) from their weights."""
        if blocks is None:
            _running_sums(self._w2d, self._run2d)
            self._bsum[:] = self._run2d[:, -1]
            return
        run = _running_sums(self._w2d[blocks], None)
        self._run2d[blocks] = run
        self._bsum[blocks] = run[:, -1]

    def delete(self, slot: int) -> None:
        self._members.delete(slot)
        self._set(slot, 0.0)

    def clear(self) -> None:
        self._members.clear()
        self._w[:] = 0.0
        self._run[:] = 0.0
        self._bsum[:] = 0.0
        self._stale, self._stale_count = [], 0
        self._cum_valid = False
        self._offload.reset()

    def total_weight(self) -> float:
        return float(self._cumsum()[-1])

    def selection_state(self) -> pb.ShardSelectionState:
        """The priority mass: a sharded client gives this shard mass / (sum over shards) of a batch."""
        return pb.ShardSelectionState(priority_mass=self.total_weight())

    def _cumsum(self) -> np.ndarray:
        """0, then the cumulative block sums (``_cum0``), brought up to date."""
        sums = self._sums()
        if not self._cum_valid:
            np.cumsum(sums, out=self._cum0[1:])
            self._cum_valid = True
        return self._cum0

    def probability(self, slots: np.ndarray) -> np.ndarray:
        """Reported probability of picking each slot now."""
        total = self.total_weight()
        if not (total > 0) or not math.isfinite(total):
            return np.full(len(slots), 1.0 / len(self))
        return self._w[slots] / total

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        slots, probs, _ = self.sample_with_repeats(n, rng)
        return slots, probs

    def sample_with_repeats(self, n: int, rng: np.random.Generator
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``sample``, and from the CPU structure the picks that repeat a slot (``Selector``'s contract)."""
        self._check_nonempty()
        cum0 = self._cumsum()
        total = float(cum0[-1])
        if not (total > 0) or not math.isfinite(total):
            slots, probs = self._members.sample(n, rng)
            return slots, probs, None
        picked = self._offload.sample(n, rng)
        if picked is not None:
            return picked[0], picked[1], None
        # n independent uniform targets in [0, total), drawn in increasing order: the running sums of
        # n + 1 exponential gaps, over their total, are n sorted uniforms
        targets = rng.standard_exponential(n + 1)
        np.cumsum(targets, out=targets)
        scale = total / targets[n]
        targets = targets[:n]
        targets *= scale
        if targets[-1] >= total:  # rounding at the very top (sorted: only the last ones)
            np.minimum(targets, np.nextafter(total, 0.0), out=targets)
        # the block of each: cum0[b] <= t < cum0[b + 1], so its sum is > 0
        pos = np.searchsorted(cum0[1:], targets, side="right")
        local = np.subtract(targets, cum0.take(pos), out=targets)  # where in its block
        # the slot in its block: a binary search over the block's running sums, all picks at once;
        # pos = block * B + j + step - 1 probes, j ending as the count of running sums <= local
        # (at most B - 1), so the slot's own weight is > 0 except where rounding clamps j
        step = self.block >> 1
        pos *= self.block
        pos += step - 1
        run = self._run
        while step > 1:
            half = step >> 1
            pos += np.where(run.take(pos) <= local, half, -half)
            step = half
        pos += run.take(pos) <= local
        weights = self._w.take(pos)
        if not weights.all():  # rounding pushed past its block's last positive weight
            for i in np.flatnonzero(weights <= 0).tolist():
                b = int(pos[i]) // self.block
                pos[i] = b * self.block + int(np.flatnonzero(self._w2d[b] > 0)[-1])
            weights = self._w.take(pos)  # still sorted: each moved to the last positive slot at or below it
        # the picks in random order: sorted pick i goes to place[i] (a uniform permutation of sorted
        # independent draws is independent draws in order); the places of a slot's repeats ascend
        place = rng.permutation(n)
        repeats = NO_REPEATS
        member = run_members(pos)
        if member is not None:
            idx = np.flatnonzero(member)  # sorted: grouped by slot
            key = pos.take(idx) * n + place.take(idx)
            key.sort()
            repeats = key % n
            place[idx] = repeats
        slots = np.empty(n, np.int64)
        slots[place] = pos
        probs = np.empty(n, np.float64)
        probs[place] = weights / total
        return slots, probs, repeats

    def snapshot(self) -> dict[str, np.ndarray]:
        return self._members.snapshot()

    def restore(self, slots, priorities, insert_seq, update_seq, state) -> None:
        self.clear()
        self._members.restore(slots, priorities, insert_seq, update_seq, state)
        slots = np.asarray(slots, np.int64)
        if slots.size:
            self.update_many(slots, np.asarray(priorities, np.float64), np.asarray(update_seq))


def _running_sums(rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Inclusive running sums along each row of ``rows`` (into ``out``, or a new array).

    Many short rows: one add per column over all rows at once, several times faster
    than ``np.cumsum(axis=1)``, whose inner loop runs once per row.
    """
    out = np.empty_like(rows) if out is None else out
    count, width = rows.shape
    if count < 16 * width:
        return np.cumsum(rows, axis=1, out=out)
    out[:, 0] = rows[:, 0]
    for j in range(1, width):
        np.add(out[:, j - 1], rows[:, j], out=out[:, j])
    return out
