"""Uniform selection: every item equally likely (reported probability 1/size)."""

from __future__ import annotations

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors.base import Selector


class Uniform(Selector):
    """A dense array of the items' slots (swap-remove), so insert, delete and a pick are O(1)."""

    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options or pb.SelectorOptions(uniform=True))
        self._items = np.empty(capacity, np.int64)
        self._pos = np.full(capacity, -1, np.int64)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def resize(self, capacity: int) -> None:
        items = np.empty(capacity, np.int64)
        items[: self._n] = self._items[: self._n]
        pos = np.full(capacity, -1, np.int64)
        pos[: self.capacity] = self._pos
        self._items, self._pos, self.capacity = items, pos, int(capacity)

    def insert(self, slot: int, priority: float, seq: int) -> None:
        if self._pos[slot] >= 0:
            raise KeyError(f"slot {slot} already tracked")
        self._items[self._n] = slot
        self._pos[slot] = self._n
        self._n += 1

    def update(self, slot: int, priority: float, seq: int) -> None:
        pass

    def update_many(self, slots, priorities, seqs) -> None:
        pass

    def delete(self, slot: int) -> None:
        p = int(self._pos[slot])
        if p < 0:
            raise KeyError(f"slot {slot} not tracked")
        last = int(self._items[self._n - 1])
        self._items[p] = last
        self._pos[last] = p
        self._pos[slot] = -1
        self._n -= 1

    def clear(self) -> None:
        self._pos[self._items[: self._n]] = -1
        self._n = 0

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_nonempty()
        idx = rng.integers(0, self._n, size=n)
        return self._items[idx], np.full(n, 1.0 / self._n)

    def slots(self) -> np.ndarray:
        """The tracked slots, in the selector's internal order."""
        return self._items[: self._n].copy()

    def snapshot(self) -> dict[str, np.ndarray]:
        return {"order": self.slots()}

    def restore(self, slots, priorities, insert_seq, update_seq, state) -> None:
        self.clear()
        order = state.get("order")
        if order is None or len(order) != len(slots):
            order = slots[np.argsort(insert_seq, kind="stable")]
        order = np.asarray(order, np.int64)
        n = len(order)
        if n > self.capacity:
            raise ValueError("more items than capacity")
        self._items[:n] = order
        self._pos[order] = np.arange(n)
        self._n = n
