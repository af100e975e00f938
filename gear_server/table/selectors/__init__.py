"""Item selectors (samplers and removers), one per file, built from gear.v1.SelectorOptions."""

from __future__ import annotations

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.selectors.base import Selector
from gear_server.table.selectors.fifo import Fifo
from gear_server.table.selectors.heap import Heap, MaxHeap, MinHeap
from gear_server.table.selectors.lifo import Lifo
from gear_server.table.selectors.prioritized import Prioritized
from gear_server.table.selectors.uniform import Uniform

__all__ = ["Selector", "Uniform", "Prioritized", "Fifo", "Lifo", "Heap", "MaxHeap", "MinHeap", "make_selector"]


def make_selector(options: pb.SelectorOptions, capacity: int) -> Selector:
    """The selector that ``options`` names, tracking up to ``capacity`` slots."""
    kind = options.WhichOneof("distribution")
    if kind == "uniform":
        return Uniform(capacity, options)
    if kind == "prioritized":
        return Prioritized(capacity, options)
    if kind == "fifo":
        return Fifo(capacity, options)
    if kind == "lifo":
        return Lifo(capacity, options)
    if kind == "heap":
        return Heap(capacity, options)
    raise ValueError("selector options name no distribution (uniform, prioritized, fifo, lifo or heap)")
