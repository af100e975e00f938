"""Where the daemon's prioritized selection runs: its CPU structure, the NumPy twin, or the GPU.

gear_server's Prioritized selector keeps a weight per slot (priority**exponent,
0 for empty slots) and a two-level sum over it; a batch of n picks costs it
O(N / block + n * block). The scan-and-search kernel costs O(N) on the GPU
and its twin O(N) on the CPU, whatever n is. ``WeightOffload`` mirrors the
selector's weight array and, per call, picks the cheapest path from crossovers
measured by ``make bench-gpu`` (docs/BENCHMARKS.md); the picks' distribution
(w / sum w) and reported probabilities are the same on every path.

``GEAR_SELECTION_BACKEND`` = auto (default) | cpu | twin | gpu forces a path
(gpu falls back to auto where no GPU is usable).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from gear_kernels import CounterRng, gpu_available, twins
from gear_kernels.backend import require_cupy, staging

BACKEND_ENV = "GEAR_SELECTION_BACKEND"
BACKENDS = ("auto", "cpu", "twin", "gpu")


@dataclass(frozen=True)
class Crossover:
    """Batch sizes above which a path beats the CPU structure, for tables of at least `capacity` slots."""

    capacity: int
    gpu_min_batch: int  # GPU from this batch size on (where a GPU is usable)
    twin_min_batch: int  # NumPy twin from this batch size on (no GPU)


NEVER = 1 << 62

# Rows by increasing capacity; the last row whose capacity <= the table's applies;
# below the first row the CPU structure always wins. The values come from
# `make bench-gpu` (crossover section: one learner step = B priority updates then
# B draws, per path); docs/BENCHMARKS.md gives the figures, machine and date.
# The twin's O(N) scan does not beat the structure's O(N / block + n * block),
# so without a GPU the CPU structure is taken; GEAR_SELECTION_BACKEND=twin
# still forces it.
CROSSOVERS: tuple[Crossover, ...] = (
    Crossover(capacity=16_384, gpu_min_batch=1024, twin_min_batch=NEVER),
)


def backend_setting() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def choose_path(capacity: int, batch: int, gpu: bool, crossovers: tuple[Crossover, ...] = CROSSOVERS) -> str:
    """'cpu', 'twin' or 'gpu' for a batch of picks from a table of `capacity` slots."""
    row = None
    for c in crossovers:
        if capacity >= c.capacity:
            row = c
    if row is None:
        return "cpu"
    if gpu and batch >= row.gpu_min_batch:
        return "gpu"
    if not gpu and batch >= row.twin_min_batch:
        return "twin"
    return "cpu"


class WeightOffload:
    """A mirror of a selector's weight array for the twin and GPU paths.

    The selector calls touch()/touch_many() for every weight it changes and
    reset() when it clears; sample() returns None when the CPU structure is the
    better path (the caller then samples as before). Callers hold the table lock.
    """

    def __init__(self, weights: np.ndarray, backend: str | None = None):
        self.weights = weights  # the selector's own array, read, never written
        self.backend = backend_setting() if backend is None else backend
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown selection backend {self.backend!r}")
        self._gpu: bool | None = None  # looked up on first need: importing CuPy is not free
        self._dirty_slots: list[int] = []
        self._dirty_arrays: list[np.ndarray] = []
        self._all_dirty = True
        self._device_w = None
        self._device_valid = None
        self._host_valid = None
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return int(self.weights.shape[0])

    @property
    def gpu(self) -> bool:
        if self._gpu is None:
            self._gpu = self.backend in ("auto", "gpu") and gpu_available()
        return self._gpu

    def path(self, batch: int) -> str:
        if self.backend == "cpu":
            return "cpu"
        if self.backend == "twin":
            return "twin"
        if self.backend == "gpu" and self.gpu:
            return "gpu"
        if (choose_path(self.capacity, batch, gpu=True) == "cpu"
                and choose_path(self.capacity, batch, gpu=False) == "cpu"):
            return "cpu"  # no need to look for a GPU
        return choose_path(self.capacity, batch, self.gpu)

    def touch(self, slot: int) -> None:
        if self._device_w is not None and not self._all_dirty:
            self._dirty_slots.append(int(slot))

    def touch_many(self, slots: np.ndarray) -> None:
        if self._device_w is not None and not self._all_dirty:
            self._dirty_arrays.append(np.array(slots, dtype=np.int64, copy=True))

    def reset(self) -> None:
        self._all_dirty = True
        self._dirty_slots.clear()
        self._dirty_arrays.clear()

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
        """n picks with probability w / sum(w), or None to leave it to the CPU structure.

        The caller has checked that sum(w) is positive and finite. The draws come
        from a counter-based generator seeded from ``rng``, so a seeded table
        repeats its selections on the same path.
        """
        path = self.path(n)
        if path == "cpu":
            return None
        counter_rng = CounterRng(int(rng.integers(0, 2**63)))
        if path == "twin":
            if self._host_valid is None or self._host_valid.shape[0] != self.capacity:
                self._host_valid = np.ones(self.capacity, dtype=bool)
            return twins.weighted_sample(self.weights, self._host_valid, n, counter_rng.state,
                                         counter_rng.take(n), 1.0)
        from gear_kernels import weighted_sample

        with self._lock:
            self._sync()
            return weighted_sample(self._device_w, self._device_valid, n, counter_rng, exponent=1.0, host=True)

    def _sync(self) -> None:
        """Bring the device mirror up to date: a full upload, or one scatter of the changed slots."""
        cp = require_cupy()
        if self._device_w is None or self._device_w.shape[0] != self.capacity:
            self._device_w = cp.empty(self.capacity, dtype=cp.float64)
            self._device_valid = cp.ones(self.capacity, dtype=cp.bool_)
            self._all_dirty = True
        if not self._all_dirty:
            parts = self._dirty_arrays + ([np.asarray(self._dirty_slots, dtype=np.int64)] if self._dirty_slots else [])
            if parts:
                # Repeated slots are fine: each entry carries the slot's current weight.
                slots = np.concatenate(parts) if len(parts) > 1 else parts[0]
                if slots.shape[0] * 8 > self.capacity:
                    self._all_dirty = True
                else:
                    from gear_kernels import scatter

                    scatter(slots, {"priority": self._device_w}, {"priority": self.weights[slots]})
        if self._all_dirty:
            (upload,) = staging().upload([self.weights])
            self._device_w[...] = upload
        self._all_dirty = False
        self._dirty_slots.clear()
        self._dirty_arrays.clear()


def describe() -> dict[str, Any]:
    """The setting and what this process can use (for logs and info)."""
    return {"backend": backend_setting(), "gpu": gpu_available(),
            "crossovers": [c.__dict__ for c in CROSSOVERS]}
