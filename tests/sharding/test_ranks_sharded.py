"""Data-parallel ranks over shards: one table over three daemons (real gRPC servers on loopback, read over
shm); rank r of world w gets rows [rB, (r+1)B) of the batch one sharded sampler with batch wB and the same
seed gets: same keys, global probabilities and global table sizes, row for row; every pick counted once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gear_client import Client
from gear_client.sharding import sharded_sampler
from gear_contract._proto import replay_pb2 as pb
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill

pytestmark = pytest.mark.timeout(120)
B, STEPS = 4, 4


def tables() -> list[pb.TableConfig]:
    prio = table_config("p", 64)
    prio.sampler.CopyFrom(pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.8)))
    return [prio, table_config("u", 64)]


@pytest.fixture(scope="module")
def shards():
    ds = [start_daemon(*tables()) for _ in range(3)]
    try:
        for i, d in enumerate(ds):  # shards of different sizes and masses
            for name in ("p", "u"):
                fill(d.tables[name], 8 + 6 * i, start=1 + 1000 * i, length=8, dim=16)
            d.tables["p"].mutate_priorities({1 + 1000 * i + k: 0.5 + k % 5 + i for k in range(8 + 6 * i)})
        yield ds
    finally:
        for d in ds:
            d.stop()


def sample(addresses: list[str], table: str, batch: int, **group) -> list:
    with sharded_sampler(addresses, table, client_type=Client, planes=["shm"], **group) as s:
        return [s.sample(batch) for _ in range(STEPS)]


def picks(ds, table: str) -> int:
    return sum(int(d.tables[table].meta.times_sampled[d.tables[table].meta.valid].sum()) for d in ds)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("table", ["p", "u"])
def test_each_rank_gets_its_rows_of_the_global_selection_over_shards(shards, world, table):
    addresses = [d.address() for d in shards]
    reference = sample(addresses, table, world * B, seed=21, world_size=1)
    assert len({int(k) // 1000 for b in reference for k in b.keys}) == 3  # every shard takes part
    before = picks(shards, table)
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            got[r] = sample(addresses, table, B, seed=21, rank=r, world_size=world)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert picks(shards, table) - before == world * B * STEPS  # each step's picks once, over all shards
    for k, full in enumerate(reference):
        for field in ("keys", "probabilities", "table_sizes"):
            joined = np.concatenate([getattr(got[r][k], field) for r in range(world)])
            assert np.array_equal(joined, getattr(full, field)), (k, field)
        assert set(full.table_sizes.tolist()) == {8 + 14 + 20}  # the global size
        if table == "p":  # the global probability: p^a over every shard's mass, the importance weights' basis
            mass = sum(float((d.tables["p"].meta.priority[d.tables["p"].meta.valid] ** 0.8).sum()) for d in shards)
            assert np.allclose(full.probabilities, full.priorities ** 0.8 / mass, rtol=1e-9)
        for r in range(world):
            check_batch(got[r][k])
    for d in shards:
        assert len(d.manager.groups) == 0 and d.tables[table].active_leases() == 0
