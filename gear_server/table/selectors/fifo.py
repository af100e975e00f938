"""First in, first out: the oldest inserted item (reported probability 1.0).

A priority update does not move an item. Items are kept in insertion order in a
deque with lazy deletion (``LazyDeletion``): a deleted item's entry stays until
it reaches an end (or a compaction drops it), so insert, delete and a pick are
O(1) amortised.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors.lazy import LazyDeletion


class InsertionOrder(LazyDeletion):
    """Items in insertion order; subclasses pick the oldest or the newest."""

    _entries: deque[tuple[int, int]]  # (insert seq, slot), seq increasing

    def _container(self, entries: list[tuple]) -> deque:
        return deque(entries)

    def insert(self, slot: int, priority: float, seq: int) -> None:
        self._check_tracked(slot, False)
        if self._entries and seq <= self._entries[-1][0]:
            raise ValueError("insertion sequence numbers must increase")
        self._live[slot] = seq
        self._entries.append((seq, slot))
        self._n += 1

    def update(self, slot: int, priority: float, seq: int) -> None:
        pass

    def update_many(self, slots, priorities, seqs) -> None:
        pass

    def restore(self, slots, priorities, insert_seq, update_seq, state) -> None:
        slots = np.asarray(slots, np.int64)
        seqs = np.asarray(insert_seq, np.int64)
        order = np.argsort(seqs, kind="stable")
        self._load(zip(seqs[order].tolist(), slots[order].tolist(), strict=True))

    def oldest(self) -> int:
        q = self._entries
        while not self._is_live(q[0]):
            q.popleft()
        return q[0][1]

    def newest(self) -> int:
        q = self._entries
        while not self._is_live(q[-1]):
            q.pop()
        return q[-1][1]


class Fifo(InsertionOrder):
    """Picks the item inserted first."""

    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options or pb.SelectorOptions(fifo=True))

    def _pick(self) -> int:
        return self.oldest()
