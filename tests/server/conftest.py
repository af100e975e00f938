"""Fixtures for the daemon's table tests: a real /dev/shm segment store per test."""

from __future__ import annotations

import math
import os
import uuid

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.storage import SegmentStore
from gear_server.table.table import ItemToInsert, Table

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None

MIN_FLOAT = -1.7976931348623157e308
MAX_FLOAT = 1.7976931348623157e308


@pytest.fixture
def store():
    """A SegmentStore under /dev/shm with an instance name unique to this test; checks nothing leaks."""
    if SHM is None:
        pytest.skip("no /dev/shm")
    s = SegmentStore(SHM, f"test{uuid.uuid4().hex[:12]}")
    yield s
    s.close()
    leaked = [n for n in os.listdir(SHM) if n.startswith(f"gear.{s.instance}.")]
    for n in leaked:
        os.unlink(os.path.join(SHM, n))
    assert not leaked, f"segments left behind: {leaked}"


def selector(kind: str, exponent: float = 1.0) -> pb.SelectorOptions:
    if kind == "uniform":
        return pb.SelectorOptions(uniform=True)
    if kind == "prioritized":
        return pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=exponent))
    if kind == "fifo":
        return pb.SelectorOptions(fifo=True)
    if kind == "lifo":
        return pb.SelectorOptions(lifo=True)
    if kind == "max_heap":
        return pb.SelectorOptions(heap=pb.HeapOptions(min_heap=False))
    if kind == "min_heap":
        return pb.SelectorOptions(heap=pb.HeapOptions(min_heap=True))
    raise ValueError(kind)


def min_size(n: int = 1) -> pb.RateLimiterOptions:
    return pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=n, min_diff=MIN_FLOAT, max_diff=MAX_FLOAT)


def config(name: str = "t", sampler: str = "uniform", remover: str = "fifo", max_size: int = 100,
           rate_limiter: pb.RateLimiterOptions | None = None, max_times_sampled: int = 0,
           signature: pb.Signature | None = None, exponent: float = 1.0, initial_max_length: int = 0
           ) -> pb.TableConfig:
    cfg = pb.TableConfig(name=name, sampler=selector(sampler, exponent), remover=selector(remover, exponent),
                         max_size=max_size, rate_limiter=rate_limiter or min_size(1),
                         max_times_sampled=max_times_sampled, initial_max_length=initial_max_length)
    if signature is not None:
        cfg.signature.CopyFrom(signature)
    return cfg


LEAF = pb.Structure()
OBS_ACT = pb.Structure(kind=pb.Structure.DICT, keys=["act", "obs"], children=[pb.Structure(), pb.Structure()])


def item(key: int, priority: float = 1.0, length: int = 3, *, episode: int | None = None) -> ItemToInsert:
    """An {'act': int64 scalar (squeezed), 'obs': float32 [length, 2]} item whose values encode its key."""
    obs = np.arange(length * 2, dtype=np.float32).reshape(length, 2) + 1000 * key
    act = np.array(key, np.int64)
    return ItemToInsert(key=key, priority=priority, structure=OBS_ACT, columns=[act, obs], squeeze=[True, False],
                        episode_ids=frozenset() if episode is None else frozenset({episode}))


def check_item_data(key: int, act: np.ndarray, obs: np.ndarray, length: int = 3) -> None:
    expect = np.arange(length * 2, dtype=np.float32).reshape(length, 2) + 1000 * key
    assert int(act) == key
    np.testing.assert_array_equal(obs, expect)


def make_table(store, **kwargs) -> Table:
    seed = kwargs.pop("seed", 0)
    spare = kwargs.pop("spare_slots", None)
    return Table(config(**kwargs), store, seed=seed, spare_slots=spare)


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
