"""Max/min heap: the item of highest (lowest) priority (reported probability 1.0).

Ties go to the item least recently inserted or updated (smallest sequence
number). A binary heap with lazy deletion: an update pushes a new entry and the
old one is dropped when it surfaces (or at compaction), so updates and deletes
are O(log N) amortised.
"""

from __future__ import annotations

import heapq

import numpy as np

from gear_client._proto import replay_pb2 as pb
from gear_server.selectors.base import Selector


class Heap(Selector):
    _COMPACT_SLACK = 1024

    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None, *, min_heap: bool | None = None):
        if options is None:
            options = pb.SelectorOptions(heap=pb.HeapOptions(min_heap=bool(min_heap)))
        super().__init__(capacity, options)
        self.min_heap = options.heap.min_heap if min_heap is None else bool(min_heap)
        self._sign = 1.0 if self.min_heap else -1.0
        self._heap: list[tuple[float, int, int]] = []  # (sign * priority, seq, slot)
        self._live = [-1] * capacity  # slot -> seq of its live entry
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def resize(self, capacity: int) -> None:
        self._live.extend([-1] * (capacity - self.capacity))
        self.capacity = int(capacity)

    def insert(self, slot: int, priority: float, seq: int) -> None:
        if self._live[slot] != -1:
            raise KeyError(f"slot {slot} already tracked")
        self._n += 1
        self._push(slot, priority, seq)

    def update(self, slot: int, priority: float, seq: int) -> None:
        if self._live[slot] == -1:
            raise KeyError(f"slot {slot} not tracked")
        self._push(slot, priority, seq)
        self._maybe_compact()

    def _push(self, slot: int, priority: float, seq: int) -> None:
        self._live[slot] = seq
        heapq.heappush(self._heap, (self._sign * priority, seq, slot))

    def delete(self, slot: int) -> None:
        if self._live[slot] == -1:
            raise KeyError(f"slot {slot} not tracked")
        self._live[slot] = -1
        self._n -= 1
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * self._n + self._COMPACT_SLACK:
            live = self._live
            self._heap = [e for e in self._heap if live[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        for entry in self._heap:
            self._live[entry[2]] = -1
        self._heap = []
        self._n = 0

    def top(self) -> int:
        h, live = self._heap, self._live
        while live[h[0][2]] != h[0][1]:
            heapq.heappop(h)
        return h[0][2]

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_nonempty()
        return np.full(n, self.top(), np.int64), np.ones(n)

    def pick_one(self, rng: np.random.Generator) -> int:
        self._check_nonempty()
        return self.top()

    def restore(self, slots, priorities, insert_seq, update_seq, state) -> None:
        self.clear()
        for slot, priority, seq in zip(np.asarray(slots).tolist(), np.asarray(priorities).tolist(),
                                       np.asarray(update_seq).tolist(), strict=True):
            self._live[slot] = seq
            self._heap.append((self._sign * priority, seq, slot))
        heapq.heapify(self._heap)
        self._n = len(self._heap)


class MaxHeap(Heap):
    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options, min_heap=False)


class MinHeap(Heap):
    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options, min_heap=True)
