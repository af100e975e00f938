"""Last in, first out: the newest inserted item (reported probability 1.0)."""

from __future__ import annotations

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors.fifo import InsertionOrder


class Lifo(InsertionOrder):
    """Picks the item inserted last; a priority update does not move an item."""

    def __init__(self, capacity: int, options: pb.SelectorOptions | None = None):
        super().__init__(capacity, options or pb.SelectorOptions(lifo=True))

    def _pick(self) -> int:
        return self.newest()
