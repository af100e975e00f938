"""The daemon's prioritized selector on its three paths: CPU structure, NumPy twin, GPU."""

from __future__ import annotations

import numpy as np
import pytest

from gear_server.table.selectors import offload
from gear_server.table.selectors.offload import BACKEND_ENV, Crossover, choose_path
from gear_server.table.selectors.prioritized import Prioritized
from tests.support.statistics import P_MIN, chi_square_p, counts


def test_choose_path_follows_the_crossover_table():
    table = (Crossover(1000, gpu_min_batch=64, twin_min_batch=10_000),
             Crossover(100_000, gpu_min_batch=8, twin_min_batch=2_000))
    assert choose_path(999, 10**6, gpu=True, crossovers=table) == "cpu"
    assert choose_path(1000, 63, gpu=True, crossovers=table) == "cpu"
    assert choose_path(1000, 64, gpu=True, crossovers=table) == "gpu"
    assert choose_path(5000, 10_000, gpu=False, crossovers=table) == "twin"
    assert choose_path(100_000, 8, gpu=True, crossovers=table) == "gpu"
    assert choose_path(100_000, 1999, gpu=False, crossovers=table) == "cpu"
    assert choose_path(100_000, 2000, gpu=False, crossovers=table) == "twin"


def test_backend_setting_is_validated(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "quantum")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        offload.backend_setting()
    monkeypatch.setenv(BACKEND_ENV, " Twin ")
    assert offload.backend_setting() == "twin"


def _filled(capacity: int, seed: int, exponent: float = 0.7) -> tuple[Prioritized, np.ndarray]:
    g = np.random.default_rng(seed)
    sel = Prioritized(capacity, priority_exponent=exponent)
    priorities = g.uniform(0.0, 3.0, capacity)
    priorities[g.random(capacity) < 0.1] = 0.0
    for slot in range(capacity):
        sel.insert(slot, float(priorities[slot]), slot)
    return sel, priorities


def _expected(sel: Prioritized, priorities: np.ndarray, live: np.ndarray) -> np.ndarray:
    w = np.where(live & (priorities > 0), np.power(priorities, sel.exponent), 0.0)
    return w / w.sum()


def test_twin_path_keeps_reverb_probabilities(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "twin")
    capacity, draws = 400, 300_000
    sel, priorities = _filled(capacity, 1)
    live = np.ones(capacity, bool)
    # changes after construction reach the twin (it reads the selector's weights)
    for slot in (3, 50, 51):
        sel.delete(slot)
        live[slot] = False
    sel.update_many(np.array([7, 8]), np.array([2.5, 0.0]), np.array([1000, 1001]))
    priorities[[7, 8]] = [2.5, 0.0]
    assert sel._offload.path(draws) == "twin"
    slots, probs = sel.sample(draws, np.random.default_rng(2))
    p = _expected(sel, priorities, live)
    assert (p[slots] > 0).all()
    np.testing.assert_allclose(probs, p[slots], rtol=1e-12)
    nz = p > 0
    assert chi_square_p(counts(slots, capacity)[nz], draws * p[nz]) >= P_MIN


def test_cpu_path_unchanged_below_crossover(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "auto")
    sel, _ = _filled(100, 3)
    assert sel._offload.path(10**6) == "cpu"  # 100 slots is below every crossover row
    assert choose_path(100, 10**6, gpu=True) == "cpu"
    assert sel._offload.sample(5, np.random.default_rng(0)) is None


@pytest.mark.gpu
def test_gpu_path_matches_twin_exactly_through_updates(cupy, monkeypatch):
    capacity = 70_001
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    gpu_sel, priorities = _filled(capacity, 4)
    monkeypatch.setenv(BACKEND_ENV, "twin")
    twin_sel, _ = _filled(capacity, 4)
    g = np.random.default_rng(5)
    rng_a, rng_b = np.random.default_rng(6), np.random.default_rng(6)

    def both(fn):
        fn(gpu_sel)
        fn(twin_sel)

    for step in range(6):
        a = gpu_sel.sample(4096, rng_a)
        b = twin_sel.sample(4096, rng_b)
        assert gpu_sel._offload.path(4096) == "gpu"
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        k = [10, 5000, capacity // 4, 3, 1, 200][step]  # small and full mirror syncs
        slots = g.choice(capacity, k, replace=False)
        vals = g.uniform(0.0, 2.0, k)
        seqs = np.arange(k) + 10**6
        both(lambda s, slots=slots, vals=vals, seqs=seqs: s.update_many(slots, vals, seqs))
        victim = int(g.integers(capacity))
        if len(gpu_sel._members) and gpu_sel._members._pos[victim] >= 0:
            both(lambda s, victim=victim: s.delete(victim))
    both(lambda s: s.clear())
    both(lambda s: s.insert(17, 1.5, 10**7))
    a = gpu_sel.sample(100, rng_a)
    b = twin_sel.sample(100, rng_b)
    assert (a[0] == 17).all() and (b[0] == 17).all()
