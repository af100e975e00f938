"""NumPy twins of the selection and collection kernels.

Each function computes what its kernel computes, with the same semantics and,
where the kernel's arithmetic is the same IEEE operations in the same order,
the same bits: the weight scan is folded tile by tile exactly as the kernel
folds it, and random numbers come from the same counter-based generator
(rng.py). The twins are the reference in tests and the path taken where there
is no GPU. Inputs are the table's metadata arrays, indexed by slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import rng

# Mirrors select.cu.
SCAN_THREADS = 256
SCAN_ITEMS = 16
SCAN_TILE = SCAN_THREADS * SCAN_ITEMS


def weights(priority: np.ndarray, valid: np.ndarray, exponent: float, uniform: bool = False) -> np.ndarray:
    """Selection weight per slot: priority**exponent for valid slots, 0 for priority 0 (any exponent)."""
    valid = np.asarray(valid, dtype=bool)
    w = np.zeros(valid.shape[0], dtype=np.float64)
    if uniform:
        w[valid] = 1.0
        return w
    priority = np.asarray(priority, dtype=np.float64)
    live = valid & (priority > 0)
    if exponent == 1.0:
        w[live] = priority[live]
    elif exponent == 0.0:
        w[live] = 1.0
    else:
        w[live] = np.power(priority[live], float(exponent))
    return w


def canonical_order(n: int) -> np.ndarray:
    """Slots in the kernel's cumulative order: tile by tile; in a tile, subtile m
    (slots tile0 + k * 256 + m, k = 0..15) by subtile, k within it. Only slots < n."""
    nb = max(1, -(-n // SCAN_TILE))
    order = np.arange(nb * SCAN_TILE, dtype=np.int64).reshape(nb, SCAN_ITEMS, SCAN_THREADS).transpose(0, 2, 1)
    order = order.reshape(-1)
    return order[order < n]


class TiledScan:
    """The kernel's cumulative sums (gear_weight_scan), with the same additions in the same order.

    run[j, k, m]: subtile m's fold of its first k + 1 weights; sub_prefix[j, m]:
    subtile m's exclusive prefix in tile j; block_sum[j]; block_prefix[nb + 1].
    """

    def __init__(self, w: np.ndarray):
        n = w.shape[0]
        self.n = n
        self.nb = nb = max(1, -(-n // SCAN_TILE))
        padded = np.zeros(nb * SCAN_TILE, dtype=np.float64)
        padded[:n] = w
        self.w = padded.reshape(nb, SCAN_ITEMS, SCAN_THREADS)
        self.run = np.cumsum(self.w, axis=1)
        incl = np.cumsum(self.run[:, -1, :], axis=1)
        self.sub_prefix = np.zeros_like(incl)
        self.sub_prefix[:, 1:] = incl[:, :-1]
        self.block_sum = incl[:, -1].copy()
        self.block_prefix = np.zeros(nb + 1, dtype=np.float64)
        self.block_prefix[1:] = np.cumsum(self.block_sum)

    def search(self, t: np.ndarray, total: float) -> np.ndarray:
        """The kernel's three-level search for each target t (gear_weighted_search)."""
        nb = self.nb
        tile = np.searchsorted(self.block_prefix[1:], t, side="right")
        tile[tile >= nb] = np.searchsorted(self.block_prefix[1:], total, side="left")
        r = t - self.block_prefix[tile]
        slots = np.empty(t.shape[0], dtype=np.int64)
        for j in np.unique(tile).tolist():
            pick = tile == j
            rj = r[pick]
            incl = np.append(self.sub_prefix[j, 1:], self.block_sum[j])
            m = np.searchsorted(incl, rj, side="right")
            m[m >= SCAN_THREADS] = np.searchsorted(incl, self.block_sum[j], side="left")
            vals = self.sub_prefix[j, m][:, None] + self.run[j][:, m].T  # [draws, 16]
            k = np.argmax(vals > rj[:, None], axis=1)
            none = ~(vals > rj[:, None]).any(axis=1)
            if none.any():
                k[none] = np.argmax(vals[none] >= vals[none, -1:], axis=1)
            slots[pick] = j * SCAN_TILE + k * SCAN_THREADS + m
        return slots


def tiled_scan(w: np.ndarray) -> TiledScan:
    """The kernel's cumulative sums over weights w (see TiledScan)."""
    return TiledScan(w)


def weighted_sample(priority: np.ndarray, valid: np.ndarray, batch: int, state: int, counter0: int,
                    exponent: float = 1.0, uniform: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Draw `batch` slots with replacement: (slots int64, probabilities float64).

    Prioritized (uniform=False): probability w / sum(w); all-zero weights fall
    back to uniform over the valid slots. Uniform: 1 / n_valid (the
    floor(u * n_valid)-th valid slot in canonical order). Draw s uses counter
    counter0 + s. No valid slot: every slot is -1, probability 0.
    """
    valid = np.asarray(valid, dtype=bool)
    n_valid = int(np.count_nonzero(valid))
    if n_valid == 0:
        return np.full(batch, -1, dtype=np.int64), np.zeros(batch)
    u = rng.random_unit(state, counter0, batch)
    w = weights(priority, valid, exponent, uniform)
    scan = tiled_scan(w)
    total = scan.block_prefix[-1]
    if uniform or not total > 0:
        idx = np.minimum((u * float(n_valid)).astype(np.int64), n_valid - 1)
        if uniform:
            slots = scan.search(idx.astype(np.float64), total)
        else:
            order = canonical_order(valid.shape[0])
            slots = order[valid[order]][idx]
        return slots, np.full(batch, 1.0 / n_valid)
    slots = scan.search(u * total, total)
    return slots, w[slots] / total


def last_occurrences(slots: np.ndarray) -> np.ndarray:
    """Indices of each distinct slot's last entry (duplicates: the last one wins)."""
    slots = np.asarray(slots, dtype=np.int64)
    _, first_in_reversed = np.unique(slots[::-1], return_index=True)
    return np.sort(slots.shape[0] - 1 - first_in_reversed)


def scatter(slots: np.ndarray, targets: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
    """targets[f][slots] = values[f] for each field; a duplicated slot takes its last entry."""
    keep = last_occurrences(slots)
    chosen = np.asarray(slots, dtype=np.int64)[keep]
    for target, value in zip(targets, values, strict=True):
        target[chosen] = np.asarray(value)[keep]


def window_bounds(length: np.ndarray, start: np.ndarray, window: int, max_length: int, pad_head: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_first, n_valid, dst_first) per item, as gear_gather computes them."""
    L = np.clip(np.asarray(length, dtype=np.int64), 0, max_length)
    start = np.asarray(start, dtype=np.int64)
    s0 = np.where(start >= 0, start, L + start)
    src_first = np.maximum(s0, 0)
    src_end = np.minimum(s0 + window, L)
    n_valid = np.maximum(src_end - src_first, 0)
    dst_first = window - n_valid if pad_head else np.zeros_like(n_valid)
    return src_first, n_valid, dst_first
