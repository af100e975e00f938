"""Checksummed trajectories: make them, insert or write them, and check every item read back is whole.

Items follow the core workload: ``{obs: float32[T, D], action: int64[T],
reward: float32[T]}`` (columns in that order: action, obs, reward). Every item
embeds a checksum: ``action[0]`` is the item's seed and ``action[1]`` the CRC32
of its obs and reward bytes, so a torn item (bytes of two items mixed) is caught.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from collections.abc import Callable

import numpy as np

from gear_contract import nest
from gear_server.table.table import ItemToInsert

STRUCTURE = nest.structure_of({"obs": 0, "action": 0, "reward": 0})
ACTION, OBS, REWARD = 0, 1, 2


def make_item(seed: int, length: int = 64, dim: int = 1024) -> dict[str, np.ndarray]:
    """A checksummed trajectory (see module docstring)."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((length, dim), dtype=np.float32)
    reward = rng.standard_normal(length, dtype=np.float32)
    action = np.arange(length, dtype=np.int64)
    action[0] = seed
    if length > 1:
        action[1] = zlib.crc32(obs.tobytes() + reward.tobytes())
    return {"action": action, "obs": obs, "reward": reward}


def write_trajectories(address: str, first: int, count: int, length: int, dim: int, *, end_episodes: bool = True,
                       report: Callable[[], dict] | None = None) -> dict:
    """An actor: items of seeds [first, first + count) written step by step through an ordinary
    TrajectoryWriter to table "t". Returns whether its items took the insert plane, and with ``report``
    what that measures once the writer flushed (before it closes)."""
    import gear_client as reverb

    client = reverb.Client(address)
    with client.trajectory_writer(length) as w:
        for seed in range(first, first + count):
            item = make_item(seed, length, dim)
            for t in range(length):
                w.append({k: v[t] for k, v in item.items()})
            w.create_item("t", 1.0, {k: w.history[k][-length:] for k in ("action", "obs", "reward")})
            if end_episodes:
                w.end_episode()
        out = {"insert_plane": w._same_host.writer is not None}
        if report is not None:
            w.flush()
            out.update(report())
    return out


def item_ok(action: np.ndarray, obs: np.ndarray, reward: np.ndarray) -> bool:
    """Whether one item's columns (its own length) carry a matching checksum."""
    return int(action[1]) == zlib.crc32(np.ascontiguousarray(obs).tobytes() + np.ascontiguousarray(reward).tobytes())


def insert(table, seed: int, length: int = 64, dim: int = 1024, key: int | None = None) -> None:
    item = make_item(seed, length, dim)
    table.insert(ItemToInsert(key=seed if key is None else key, priority=1.0, structure=STRUCTURE,
                              columns=[item["action"], item["obs"], item["reward"]], squeeze=[False] * 3))


def fill(table, n: int, start: int = 1, **kwargs) -> None:
    for seed in range(start, start + n):
        insert(table, seed, **kwargs)


def check_batch(batch) -> int:
    """Assert every item of a SampledBatch is intact and matches its key; returns the item count."""
    action, obs, reward = batch.columns
    for i in range(len(batch)):
        n = int(batch.lengths[i, ACTION])
        assert item_ok(action[i, :n], obs[i, :n], reward[i, :n]), f"item {i} (key {batch.keys[i]}) is torn"
        assert int(action[i, 0]) == int(batch.keys[i]), "the data does not belong to the reported key"
    return len(batch)


class Churn:
    """A writer thread inserting (and so evicting) checksummed items as fast as it can, until stopped."""

    def __init__(self, table, length: int = 64, dim: int = 1024, first_seed: int = 1000):
        self.table = table
        self.inserted = 0
        self._stop = threading.Event()
        self._seeds = itertools.count(first_seed)
        self._args = (length, dim)
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            insert(self.table, next(self._seeds), *self._args)
            self.inserted += 1

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
