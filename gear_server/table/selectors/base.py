"""The interface every selector (sampler or remover) implements.

Selectors track the table's items by slot. The table tells them about every
insert, priority update and delete (with the table-wide sequence number of that
event, which orders insertions and breaks heap ties) and asks them to pick
``n`` slots with the probability Reverb reports for each pick.
"""

from __future__ import annotations

import numpy as np

from gear_contract._proto import replay_pb2 as pb


class Selector:
    """Base class: one selector instance serves as a table's sampler or its remover."""

    def __init__(self, capacity: int, options: pb.SelectorOptions):
        self.capacity = int(capacity)
        self._options = pb.SelectorOptions()
        self._options.CopyFrom(options)

    @property
    def options(self) -> pb.SelectorOptions:
        return self._options

    def __len__(self) -> int:
        raise NotImplementedError

    def resize(self, capacity: int) -> None:
        """Grow to track slots up to ``capacity`` (items keep their slots)."""
        raise NotImplementedError

    def insert(self, slot: int, priority: float, seq: int) -> None:
        raise NotImplementedError

    def update(self, slot: int, priority: float, seq: int) -> None:
        raise NotImplementedError

    def update_many(self, slots: np.ndarray, priorities: np.ndarray, seqs: np.ndarray) -> None:
        """Apply updates in order (slots are distinct)."""
        for slot, priority, seq in zip(slots.tolist(), priorities.tolist(), seqs.tolist(), strict=True):
            self.update(slot, priority, seq)

    def delete(self, slot: int) -> None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` independent picks from the current items: (slots int64[n], probabilities float64[n])."""
        raise NotImplementedError

    def sample_with_repeats(self, n: int, rng: np.random.Generator
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``sample``'s picks and, when the selector knows them for free, the positions of the picks
        whose slot is picked more than once, grouped by slot and ascending in a group (empty: all
        distinct; None: not known, the caller finds them). The table counts repeats with them."""
        slots, probs = self.sample(n, rng)
        return slots, probs, None

    def selection_state(self) -> pb.ShardSelectionState:
        """How the next picks would go, for a client splitting a batch over shards (docs/SHARDING.md)."""
        return pb.ShardSelectionState()

    def pick_one(self, rng: np.random.Generator) -> int:
        """One pick's slot (what a remover deletes)."""
        return int(self.sample(1, rng)[0][0])

    def snapshot(self) -> dict[str, np.ndarray]:
        """State that cannot be rebuilt from the items' metadata (arrays of slots)."""
        return {}

    def restore(self, slots: np.ndarray, priorities: np.ndarray, insert_seq: np.ndarray,
                update_seq: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Rebuild from the items' metadata (and ``state`` from ``snapshot`` with slots remapped)."""
        self.clear()
        order = np.argsort(insert_seq, kind="stable")
        for i in order.tolist():
            self.insert(int(slots[i]), float(priorities[i]), int(insert_seq[i]))
        if len(slots):
            self.update_many(slots, priorities, update_seq)

    def _check_nonempty(self) -> None:
        if len(self) == 0:
            raise RuntimeError("selector has no items to select from")
