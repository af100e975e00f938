"""Counter-based random numbers shared by the kernels and their NumPy twins.

A draw is a pure function of ``(seed, counter)``: the splitmix64 output
function of ``mix(seed) + (counter + 1) * golden`` (gear_common.cuh computes
the same). So a selection depends only on the seed and how many draws came
before it, never on threads or block order, and the twin reproduces the GPU's
random numbers exactly.
"""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 values (wrapping arithmetic)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def seed_state(seed: int) -> int:
    """The 64-bit state a seed maps to (passed to the kernels as is)."""
    return int(mix64(np.array([int(seed) & _MASK64], dtype=np.uint64))[0])


def random_u64(state: int, counter0: int, count: int) -> np.ndarray:
    """uint64 draws for counters counter0 .. counter0 + count - 1."""
    counters = np.arange(count, dtype=np.uint64) + np.uint64(int(counter0) & _MASK64)
    with np.errstate(over="ignore"):
        z = np.uint64(state) + (counters + np.uint64(1)) * GOLDEN
    return mix64(z)


def random_unit(state: int, counter0: int, count: int) -> np.ndarray:
    """float64 draws in [0, 1) from the top 53 bits."""
    return (random_u64(state, counter0, count) >> np.uint64(11)).astype(np.float64) * 2.0**-53


class CounterRng:
    """A seed plus a running counter: each call takes a fresh block of counters."""

    def __init__(self, seed: int | None = None):
        if seed is None:
            seed = int.from_bytes(np.random.SeedSequence().generate_state(2, np.uint32).tobytes(), "little")
        self.seed = int(seed) & _MASK64
        self.state = seed_state(self.seed)
        self.counter = 0

    def take(self, count: int) -> int:
        """Reserve ``count`` counters; returns the first."""
        first = self.counter
        self.counter = (self.counter + int(count)) & _MASK64
        return first
