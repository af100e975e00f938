"""Max/min heap: the item of highest (lowest) priority (reported probability 1.0).

Ties go to the item least recently inserted or updated (smallest sequence
number). A binary heap with lazy deletion (``LazyDeletion``): an update pushes a
new entry and the old one is dropped when it surfaces (or at compaction), so
updates and deletes are O(log N) amortised.
"""

from __future__ import annotations

import heapq

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors.lazy import LazyDeletion


class Heap(LazyDeletion):
    _entries: list[tuple[float, int, int]]  # (sign * priority, seq, slot), a heap

    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None, *, min_heap: bool | None = None):
        if options is None:
            options = pb.SelectorOptions(heap=pb.HeapOptions(min_heap=bool(min_heap)))
        super().__init__(capacity, options)
        self.min_heap = options.heap.min_heap if min_heap is None else bool(min_heap)
        self._sign = 1.0 if self.min_heap else -1.0

    def _container(self, entries: list[tuple]) -> list:
        heapq.heapify(entries)
        return entries

    def insert(self, slot: int, priority: float, seq: int) -> None:
        self._check_tracked(slot, False)
        self._n += 1
        self._push(slot, priority, seq)

    def update(self, slot: int, priority: float, seq: int) -> None:
        self._check_tracked(slot, True)
        self._push(slot, priority, seq)
        self._maybe_compact()

    def _push(self, slot: int, priority: float, seq: int) -> None:
        self._live[slot] = seq
        heapq.heappush(self._entries, (self._sign * priority, seq, slot))

    def _pick(self) -> int:
        h = self._entries
        while not self._is_live(h[0]):
            heapq.heappop(h)
        return h[0][2]

    def selection_state(self) -> pb.ShardSelectionState:
        """The head's priority: a sharded client takes a batch from the shard whose head is best."""
        if self._n == 0:
            return pb.ShardSelectionState()
        self._pick()  # drops dead entries above the head
        return pb.ShardSelectionState(has_head=True, head_priority=self._sign * self._entries[0][0])

    def restore(self, slots, priorities, insert_seq, update_seq, state) -> None:
        self._load((self._sign * priority, seq, slot) for slot, priority, seq in zip(
            np.asarray(slots).tolist(), np.asarray(priorities).tolist(), np.asarray(update_seq).tolist(), strict=True))


class MaxHeap(Heap):
    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options, min_heap=False)


class MinHeap(Heap):
    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options, min_heap=True)
