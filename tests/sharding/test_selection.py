"""The sharding pieces that need no daemon: address specs, the global split, probabilities, assembly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gear_client.data_planes.batch import SampledBatch
from gear_client.sharding.assembly import assemble
from gear_client.sharding.membership import join_host_port, resolve, shard_addresses, split_host_port
from gear_client.sharding.selection import Policy, ShardWeight, globalise, selection_mass, split
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract.selectors import priority_weights

ROOT = Path(__file__).resolve().parents[2]
PRIO = Policy("prioritized", exponent=0.5)


def test_address_specs():
    assert shard_addresses("a:1") is None  # one daemon: a plain Client
    assert shard_addresses(["a:1", " b:2"]) == ["a:1", "b:2"]
    assert shard_addresses("a:1, b:2") == ["a:1", "b:2"]
    assert shard_addresses("shards:replay.example:8000") == ["replay.example:8000"]
    for bad in ([], ["a:1", ""], [3]):
        with pytest.raises(ValueError):
            shard_addresses(bad)
    assert split_host_port("[::1]:80") == ("::1", 80)
    assert join_host_port("::1", 80) == "[::1]:80" and join_host_port("10.0.0.1", 80) == "10.0.0.1:80"
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port("nohost")
    assert "127.0.0.1:9" in resolve("localhost:9") or resolve("localhost:9") == ["localhost:9"]
    assert resolve("127.0.0.1:9") == ["127.0.0.1:9"]


def test_prioritized_split_follows_the_masses_and_falls_back_to_sizes():
    rng = np.random.default_rng(0)
    weights = [ShardWeight(0, 10, 1.0), ShardWeight(1, 10, 3.0), ShardWeight(2, 0, 0.0), ShardWeight(3, 5, 0.0)]
    totals = np.zeros(4)
    for _ in range(50):
        for s, n in split(PRIO, weights, 1000, rng).items():
            totals[s] += n
    assert totals[2] == totals[3] == 0  # empty, and no mass while others have some
    assert totals[1] / totals.sum() == pytest.approx(0.75, abs=0.01)
    zero = [ShardWeight(0, 10, 0.0), ShardWeight(1, 30, 0.0)]
    counts = split(PRIO, zero, 40000, rng)
    assert counts[1] / 40000 == pytest.approx(0.75, abs=0.01)  # every mass 0: uniform, as one table
    assert split(PRIO, [ShardWeight(0, 0)], 8, rng) == {}


def test_uniform_fifo_split_by_size_and_heaps_take_the_best_head():
    rng = np.random.default_rng(1)
    counts = split(Policy("uniform"), [ShardWeight(0, 100), ShardWeight(1, 300)], 40000, rng)
    assert counts[1] / 40000 == pytest.approx(0.75, abs=0.01)
    heads = [ShardWeight(0, 5, head=2.0), ShardWeight(1, 5, head=7.0), ShardWeight(2, 5, head=-1.0)]
    assert split(Policy("heap"), heads, 9, rng) == {1: 9}
    assert split(Policy("heap", min_heap=True), heads, 9, rng) == {2: 9}


def test_reported_probabilities_are_global():
    priorities = {0: np.array([1.0, 4.0]), 1: np.array([9.0])}
    local_mass = {0: 10.0, 1: 20.0}
    parts = {s: (p, priority_weights(p, 0.5) / local_mass[s], np.array([7] * len(p))) for s, p in priorities.items()}
    weights = {0: ShardWeight(0, 7, 10.0), 1: ShardWeight(1, 7, 20.0), 2: ShardWeight(2, 6, 30.0)}
    size, probs = globalise(PRIO, weights, parts)
    assert size == 20
    np.testing.assert_allclose(np.concatenate(probs), np.array([1.0, 2.0, 3.0]) / 60.0)
    assert selection_mass(PRIO, priorities[1], parts[1][1]) == pytest.approx(20.0)
    _, uniform = globalise(Policy("uniform"), weights, parts)
    np.testing.assert_allclose(np.concatenate(uniform), 1 / 20)


def _part(keys, steps, plane):
    n = len(keys)
    obs = np.stack([np.full((steps, 2), k, np.float32) for k in keys])
    flag = np.array(keys, np.int64)
    return SampledBatch(np.array(keys, np.uint64), np.full(n, 0.5), np.full(n, 9), np.ones(n), np.ones(n, np.int32),
                        [flag, obs], np.array([[1, steps]] * n, np.int32), nest.structure_of((0, 0)),
                        (True, False), plane=plane)


def test_assembly_shuffles_rows_pads_columns_and_keeps_rows_together():
    batch = assemble([_part([1, 2], 3, "shm"), _part([3, 4, 5], 5, "inline")], np.random.default_rng(2))
    assert sorted(batch.keys.tolist()) == [1, 2, 3, 4, 5] and batch.plane == "inline+shm"
    flag, obs = batch.columns
    assert obs.shape == (5, 5, 2)
    for i, key in enumerate(batch.keys.tolist()):
        steps = int(batch.lengths[i, 1])
        assert flag[i] == key and steps == (3 if key <= 2 else 5)
        assert np.all(obs[i, :steps] == key) and np.all(obs[i, steps:] == 0)
    with pytest.raises(ValueError, match="different structures"):
        other = _part([6], 3, "shm")
        other.structure = nest.structure_of([0, 0])
        assemble([_part([1], 3, "shm"), other], np.random.default_rng(0))


def test_three_node_example_config_loads():
    from gear_server.config import load_config

    settings = load_config(ROOT / "deploy" / "sharding" / "gear-shard.toml")
    assert [t.name for t in settings.server.tables] == ["replay"]
    assert settings.server.port == 8000


def test_policy_of_options():
    assert Policy.of(pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.7))).exponent == 0.7
    assert Policy.of(pb.SelectorOptions(heap=pb.HeapOptions(min_heap=True))).min_heap
    with pytest.raises(ValueError):
        Policy.of(pb.SelectorOptions())
