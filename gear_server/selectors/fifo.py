"""First in, first out: the oldest inserted item (reported probability 1.0).

A priority update does not move an item. Items are kept in insertion order in a
deque with lazy deletion: a deleted item's entry stays until it reaches an end
(or a compaction drops it), so insert, delete and a pick are O(1) amortised.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from gear_client._proto import replay_pb2 as pb
from gear_server.selectors.base import Selector


class InsertionOrder(Selector):
    """Items in insertion order; subclasses pick the oldest or the newest."""

    _COMPACT_SLACK = 1024

    def __init__(self, capacity: int, options: pb.SelectorOptions):
        super().__init__(capacity, options)
        self._queue: deque[tuple[int, int]] = deque()  # (insert seq, slot), seq increasing
        self._live = [-1] * capacity  # slot -> insert seq of its live entry, -1 when absent
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def resize(self, capacity: int) -> None:
        self._live.extend([-1] * (capacity - self.capacity))
        self.capacity = int(capacity)

    def insert(self, slot: int, priority: float, seq: int) -> None:
        if self._live[slot] != -1:
            raise KeyError(f"slot {slot} already tracked")
        if self._queue and seq <= self._queue[-1][0]:
            raise ValueError("insertion sequence numbers must increase")
        self._live[slot] = seq
        self._queue.append((seq, slot))
        self._n += 1

    def update(self, slot: int, priority: float, seq: int) -> None:
        pass

    def update_many(self, slots, priorities, seqs) -> None:
        pass

    def delete(self, slot: int) -> None:
        if self._live[slot] == -1:
            raise KeyError(f"slot {slot} not tracked")
        self._live[slot] = -1
        self._n -= 1
        if len(self._queue) > 2 * self._n + self._COMPACT_SLACK:
            live = self._live
            self._queue = deque(e for e in self._queue if live[e[1]] == e[0])

    def clear(self) -> None:
        for _, slot in self._queue:
            self._live[slot] = -1
        self._queue.clear()
        self._n = 0

    def restore(self, slots, priorities, insert_seq, update_seq, state) -> None:
        self.clear()
        slots = np.asarray(slots, np.int64)
        seqs = np.asarray(insert_seq, np.int64)
        order = np.argsort(seqs, kind="stable")
        ordered_seqs, ordered_slots = seqs[order].tolist(), slots[order].tolist()
        for slot, seq in zip(ordered_slots, ordered_seqs, strict=True):
            self._live[slot] = seq
        self._queue = deque(zip(ordered_seqs, ordered_slots, strict=True))
        self._n = len(ordered_slots)

    def oldest(self) -> int:
        q, live = self._queue, self._live
        while live[q[0][1]] != q[0][0]:
            q.popleft()
        return q[0][1]

    def newest(self) -> int:
        q, live = self._queue, self._live
        while live[q[-1][1]] != q[-1][0]:
            q.pop()
        return q[-1][1]

    def _pick(self) -> int:
        raise NotImplementedError

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_nonempty()
        return np.full(n, self._pick(), np.int64), np.ones(n)

    def pick_one(self, rng: np.random.Generator) -> int:
        self._check_nonempty()
        return self._pick()


class Fifo(InsertionOrder):
    """Picks the item inserted first."""

    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options or pb.SelectorOptions(fifo=True))

    def _pick(self) -> int:
        return self.oldest()
