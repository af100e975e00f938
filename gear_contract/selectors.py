"""Item selectors (`reverb.selectors`): which item a table samples or removes.

Each selector is a small option object that validates its arguments like
Reverb does and turns into a ``gear.v1.SelectorOptions`` with ``to_proto()``;
the daemon builds the selection strategy from that message.
"""

from __future__ import annotations

import math

import numpy as np

from gear_contract._proto import replay_pb2 as pb

__all__ = ["Fifo", "Lifo", "MaxHeap", "MinHeap", "Prioritized", "Uniform", "SelectorType", "from_proto"]


class _Selector:
    """Base of the selector option objects."""

    def to_proto(self) -> pb.SelectorOptions:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_proto() == self.to_proto()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.to_proto().SerializeToString(deterministic=True)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Uniform(_Selector):
    """Samples every item with the same probability."""

    def to_proto(self) -> pb.SelectorOptions:
        return pb.SelectorOptions(uniform=True)


class Fifo(_Selector):
    """Selects the oldest item (by insertion)."""

    def to_proto(self) -> pb.SelectorOptions:
        return pb.SelectorOptions(fifo=True, is_deterministic=True)


class Lifo(_Selector):
    """Selects the newest item (by insertion)."""

    def to_proto(self) -> pb.SelectorOptions:
        return pb.SelectorOptions(lifo=True, is_deterministic=True)


class Prioritized(_Selector):
    """Samples items with probability proportional to priority ** priority_exponent."""

    def __init__(self, priority_exponent: float):
        exponent = float(priority_exponent)
        if math.isnan(exponent) or exponent < 0:
            raise ValueError(f"priority_exponent ({priority_exponent}) must be a non-negative number")
        self.priority_exponent = exponent

    def to_proto(self) -> pb.SelectorOptions:
        return pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=self.priority_exponent))

    def __repr__(self) -> str:
        return f"Prioritized(priority_exponent={self.priority_exponent})"


class MaxHeap(_Selector):
    """Selects the item with the highest priority."""

    def to_proto(self) -> pb.SelectorOptions:
        return pb.SelectorOptions(heap=pb.HeapOptions(min_heap=False), is_deterministic=True)


class MinHeap(_Selector):
    """Selects the item with the lowest priority."""

    def to_proto(self) -> pb.SelectorOptions:
        return pb.SelectorOptions(heap=pb.HeapOptions(min_heap=True), is_deterministic=True)


SelectorType = Uniform | Prioritized | Fifo | Lifo | MaxHeap | MinHeap


def from_proto(options: pb.SelectorOptions) -> SelectorType:
    """The selector object a ``SelectorOptions`` message describes."""
    kind = options.WhichOneof("distribution")
    if kind == "uniform":
        return Uniform()
    if kind == "fifo":
        return Fifo()
    if kind == "lifo":
        return Lifo()
    if kind == "prioritized":
        return Prioritized(options.prioritized.priority_exponent)
    if kind == "heap":
        return MinHeap() if options.heap.min_heap else MaxHeap()
    raise ValueError(f"selector options name no distribution: {options}")


def priority_weights(priorities: np.ndarray, exponent: float) -> np.ndarray:
    """priority ** exponent of priorities >= 0 (checked where they come in), with priority 0 -> weight 0
    for every exponent (a prioritized pick's weight).

    The daemon's selector and a sharded client's global probabilities compute it alike.
    """
    p = np.asarray(priorities, np.float64)
    if 0.0 < exponent <= 1.0:  # 0 ** exponent is 0 and nothing overflows: one call (a mutate's latency)
        return np.power(p, exponent)
    out = np.zeros_like(p)
    with np.errstate(over="ignore"):  # an overflow gives inf, as the weight of a priority that large should
        return np.power(p, exponent, out=out, where=p > 0)


_MASK64 = (1 << 64) - 1
# Key of the client's split of a group step over shards: apart from the shards' own picks of that step.
SPLIT_KEY = 0x5EED_5917


def step_rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    """A selection group's generator for one step: counter-based (Philox), keyed by (seed, step, stream).

    The daemon draws step ``step``'s picks from stream 0; a sharded learner splits the step over the
    shards with stream ``SPLIT_KEY``. Any process gets the same draws for the same key.
    """
    return np.random.Generator(np.random.Philox(
        key=np.array([(seed ^ (stream << 32)) & _MASK64, step & _MASK64], np.uint64)))
