"""Which shard holds a key, as learnt from sampled batches (to route ``mutate_priorities`` and deletes).

A learner learns 4096 keys a batch or more, and most learners never ask: learning
must cost nothing per key. Each batch's keys of one shard are kept as the array
they came in (a copy), newest last; past ``max_keys`` the oldest arrays are
dropped. Asking searches the arrays newest first (a key sampled again from
another shard after a restore answers with its latest owner) and stops once
every key asked is found: a prioritized learner updates the keys it just
sampled, which the newest arrays hold. Each array is sorted the first time it is
searched. Keys never learnt (inserted, never sampled) come back as unknown:
the caller asks every shard.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

import numpy as np

MAX_CACHED_KEYS = 1 << 20  # keys remembered (whole arrays: the oldest go first)
UNKNOWN = -1


class _Learnt:
    """One shard's keys of one batch; sorted when first searched."""

    __slots__ = ("keys", "index", "_sorted")

    def __init__(self, keys: np.ndarray, index: int):
        self.keys = keys
        self.index = index
        self._sorted: np.ndarray | None = None

    def sorted(self) -> np.ndarray:
        if self._sorted is None:
            self._sorted = np.sort(self.keys)
        return self._sorted


class KeyOwners:
    """Key -> shard index, bounded, learnt in arrays (see module docstring). Thread safe."""

    def __init__(self, max_keys: int = MAX_CACHED_KEYS):
        self.max_keys = int(max_keys)
        self._lock = threading.Lock()
        self._learnt: deque[_Learnt] = deque()
        self._count = 0

    def __len__(self) -> int:
        """Keys remembered (a key learnt twice counts twice)."""
        return self._count

    def learn(self, keys: np.ndarray, index: int) -> None:
        """``keys`` live on shard ``index`` (copied: the caller's array may be a view of a reused buffer)."""
        keys = np.array(keys, dtype=np.uint64)
        if not keys.size:
            return
        with self._lock:
            self._learnt.append(_Learnt(keys, int(index)))
            self._count += len(keys)
            while self._count > self.max_keys and len(self._learnt) > 1:
                self._count -= len(self._learnt.popleft().keys)

    def owners(self, keys: Iterable[int] | np.ndarray) -> np.ndarray:
        """The shard index of each key (int64; ``UNKNOWN`` where never learnt), the latest learnt winning."""
        asked = _as_keys(keys)
        out = np.full(len(asked), UNKNOWN, np.int64)
        with self._lock:
            for entry, found, where in self._search(asked):
                out[where[found]] = entry.index
        return out

    def forget(self, keys: Iterable[int] | np.ndarray) -> None:
        """Forget ``keys`` (deleted items): every array holding one drops it."""
        asked = np.unique(_as_keys(keys))
        if not asked.size:
            return
        with self._lock:
            for entry in list(self._learnt):
                hit = np.isin(entry.keys, asked)
                if hit.any():
                    self._count -= int(hit.sum())
                    entry.keys = entry.keys[~hit]
                    entry._sorted = None
            self._learnt = deque(e for e in self._learnt if e.keys.size)

    def _search(self, asked: np.ndarray):
        """Yield (entry, found mask over ``where``, where): the asked positions each entry answers, newest first."""
        where = np.arange(len(asked))
        for entry in reversed(self._learnt):
            if not where.size:
                return
            keys = entry.sorted()
            wanted = asked[where]
            pos = np.searchsorted(keys, wanted)
            np.minimum(pos, len(keys) - 1, out=pos)
            found = keys[pos] == wanted
            if found.any():
                yield entry, found, where
                where = where[~found]


def _as_keys(keys: Iterable[int] | np.ndarray) -> np.ndarray:
    """``keys`` as a flat uint64 array (an iterable read once)."""
    return np.asarray(keys if isinstance(keys, np.ndarray) else list(keys), dtype=np.uint64).reshape(-1)
