"""What a priority may be: a finite number >= 0. The daemon checks every one it is given; a sharded client
checks a mutation's before sending it anywhere, so that it fails as one daemon's does (same ValueError)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def check_priority(priority: float, what: str = "priority") -> float:
    """A valid priority as float: finite and >= 0 (ValueError otherwise)."""
    try:
        value = float(priority)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a number, got {priority!r}") from e
    if math.isnan(value):
        raise ValueError(f"{what} is NaN")
    if value < 0:
        raise ValueError(f"{what} is negative: must be >= 0, got {value}")
    if math.isinf(value):
        raise ValueError(f"{what} must be finite, got {value}")
    return value + 0.0  # -0.0 -> 0.0


def check_priorities(keys: Sequence[int], priorities: np.ndarray) -> np.ndarray:
    """``priorities`` (float64) with -0.0 as 0.0; ValueError naming the first key whose new priority is
    NaN, negative or infinite."""
    if priorities.size and not (priorities.min() >= 0.0 and priorities.max() < math.inf):  # NaN fails both
        bad = np.flatnonzero(~np.isfinite(priorities) | (priorities < 0))
        i = int(bad[0])
        check_priority(priorities[i], f"new priority of key {keys[i]}")
    return priorities + 0.0
