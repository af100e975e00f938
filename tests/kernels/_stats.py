"""Goodness of fit for the sampling tests (NumPy only, so it runs in CI too).

Threshold: a sampler passes when the chi-square test's p-value is at least
P_MIN = 1e-4. Every test uses a fixed seed, so a run is deterministic; a
correct sampler would fail a given seed with probability 1e-4.
"""

from __future__ import annotations

import math

import numpy as np

P_MIN = 1e-4


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's chi-square statistic (Wilson-Hilferty approximation).

    Bins expected to hold fewer than 5 are pooled into one bin first.
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert observed.shape == expected.shape
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    assert expected.min() >= 5 and expected.shape[0] >= 10, "too few usable bins for the test"
    dof = observed.shape[0] - 1
    stat = float(np.sum((observed - expected) ** 2 / expected))
    z = ((stat / dof) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * dof))) / math.sqrt(2.0 / (9.0 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def counts(slots: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(np.asarray(slots, dtype=np.int64), minlength=n).astype(np.float64)
