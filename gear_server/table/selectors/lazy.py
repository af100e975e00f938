"""Lazy deletion, shared by the selectors that keep ordered entries (fifo/lifo, heap).

Entries are tuples ending in ``(seq, slot)``; an entry is live while
``_live[slot] == seq``. Deleting or updating an item only changes ``_live``:
stale entries are dropped when they surface, or all at once when they outnumber
the live ones (compaction), so every operation stays O(1) or O(log N) amortised.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors.base import Selector


class LazyDeletion(Selector):
    """Base for selectors over a container ``_entries`` of ``(..., seq, slot)`` tuples."""

    _COMPACT_SLACK = 1024

    def __init__(self, capacity: int, options: pb.SelectorOptions):
        super().__init__(capacity, options)
        self._live = [-1] * capacity  # slot -> seq of its live entry, -1 when absent
        self._n = 0
        self._entries = self._container([])

    def _container(self, entries: list[tuple]):
        """The subclass's container holding ``entries`` (in its order)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self._n

    def _pick(self) -> int:
        """The slot chosen next: these selectors are deterministic (probability 1.0)."""
        raise NotImplementedError

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_nonempty()
        return np.full(n, self._pick(), np.int64), np.ones(n)

    def pick_one(self, rng: np.random.Generator) -> int:
        self._check_nonempty()
        return self._pick()

    def resize(self, capacity: int) -> None:
        self._live.extend([-1] * (capacity - self.capacity))
        self.capacity = int(capacity)

    def _check_tracked(self, slot: int, tracked: bool) -> None:
        if (self._live[slot] != -1) != tracked:
            raise KeyError(f"slot {slot} {'not' if tracked else 'already'} tracked")

    def delete(self, slot: int) -> None:
        self._check_tracked(slot, True)
        self._live[slot] = -1
        self._n -= 1
        self._maybe_compact()

    def _is_live(self, entry: tuple) -> bool:
        return self._live[entry[-1]] == entry[-2]

    def _maybe_compact(self) -> None:
        if len(self._entries) > 2 * self._n + self._COMPACT_SLACK:
            self._entries = self._container([e for e in self._entries if self._is_live(e)])

    def clear(self) -> None:
        for entry in self._entries:
            self._live[entry[-1]] = -1
        self._entries = self._container([])
        self._n = 0

    def _load(self, entries: Iterable[tuple]) -> None:
        """Replace every entry by ``entries`` (one per item, all live)."""
        self.clear()
        entries = list(entries)
        for entry in entries:
            self._live[entry[-1]] = entry[-2]
        self._entries = self._container(entries)
        self._n = len(entries)
