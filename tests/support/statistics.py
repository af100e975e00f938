"""Goodness of fit for the sampling tests (NumPy only, so it runs in CI too).

chi_square_p: a sampler passes when the chi-square test's p-value is at least
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


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper critical value of chi-square with ``df`` degrees of freedom (Wilson-Hilferty).

    z = 3.0902 is the standard normal quantile of 0.999: the test rejects a correct
    sampler with probability about 0.001. The Wilson-Hilferty cube approximation is
    within 2% of the exact quantile for df >= 3, slightly above it (df=3: 16.55 vs
    16.27 exact; df=9: 28.06 vs 27.88; df=99: 148.29 vs 148.23). Seeds are fixed, so
    a run is deterministic; the threshold says how unlikely a failure of a correct
    sampler would be for a fresh seed.
    """
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(counts: np.ndarray, probabilities: np.ndarray) -> float:
    counts = np.asarray(counts, np.float64)
    expected = counts.sum() * np.asarray(probabilities, np.float64)
    return float(((counts - expected) ** 2 / expected).sum())
