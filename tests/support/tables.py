"""Table configs and items for in-process Table tests; an item's values encode its key."""

from __future__ import annotations

import os

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.table import ItemToInsert, Table

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None

MIN_FLOAT = -1.7976931348623157e308
MAX_FLOAT = 1.7976931348623157e308


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
