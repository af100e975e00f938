"""Data-parallel ranks on one global selection: rank r of world w with batch B gets rows [rB, (r+1)B) of what
one sampler with batch wB and the same seed gets; picks counted once; a rank that never comes costs bounded
memory; bad groups refused. Real daemon (gRPC on loopback), real shm, ranks as threads with their own samplers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from gear_contract._proto import replay_pb2 as pb
from gear_server.data_planes.groups import GroupRegistry
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
B = 4


def prioritized(name: str, size: int = 64) -> pb.TableConfig:
    config = table_config(name, size)
    config.sampler.CopyFrom(pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.8)))
    return config


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(prioritized("p"), table_config("u", 64), table_config("lonely", 64))
    try:
        for name in ("p", "u", "lonely"):
            fill(d.tables[name], 40, length=8, dim=16)
        d.tables["p"].mutate_priorities({key: 0.5 + (key % 7) for key in range(1, 41)})
        yield d
    finally:
        d.stop()


def world_one(d, table: str, batch: int, seed: int, steps: int = STEPS):
    with PlaneSampler(d.address(), table, planes=["shm"], seed=seed) as s:
        return [s.sample(batch) for _ in range(steps)]


def ranks(d, table: str, world: int, seed: int, steps: int = STEPS, planes_override=None, **kwargs):
    """Every rank's batches, each rank a thread with its own sampler (its own session)."""
    out: dict[int, list] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with PlaneSampler(d.address(), table, planes=planes_override or ["shm"], rank=r, world_size=world,
                              seed=seed, **kwargs) as s:
                out[r] = [s.sample(B) for _ in range(steps)]
                assert s.kind == (planes_override or ["shm"])[0]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def assert_rows_of(reference, per_rank, world: int) -> None:
    for k, full in enumerate(reference):
        assert len(full) == world * B
        for field in ("keys", "probabilities", "table_sizes", "priorities"):
            joined = np.concatenate([getattr(per_rank[r][k], field) for r in range(world)])
            assert np.array_equal(joined, getattr(full, field)), (k, field)
        for r in range(world):
            check_batch(per_rank[r][k])  # each rank's bytes are its own keys' items, whole


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("table", ["p", "u"])
def test_each_rank_gets_its_rows_of_the_one_global_selection(daemon, world, table):
    reference = world_one(daemon, table, world * B, seed=11)
    assert_rows_of(reference, ranks(daemon, table, world, seed=11), world)
    assert len(daemon.manager.groups) == 0 and daemon.tables[table].active_leases() == 0  # all ended with the ranks


def test_another_seed_gives_another_selection(daemon):
    a = world_one(daemon, "p", 8, seed=1, steps=2)
    b = world_one(daemon, "p", 8, seed=2, steps=2)
    assert any(not np.array_equal(x.keys, y.keys) for x, y in zip(a, b, strict=True))


def test_picks_are_counted_once_and_each_rank_updates_its_own_rows(daemon):
    table = daemon.tables["p"]
    before = int(table.meta.times_sampled[table.meta.valid].sum())
    per_rank = ranks(daemon, "p", 2, seed=5, steps=3)
    after = int(table.meta.times_sampled[table.meta.valid].sum())
    assert after - before == 2 * B * 3  # w B picks per step, not w times that
    client = reverb.Client(daemon.address())
    updated = {}
    for r, batches in per_rank.items():  # each rank updates the keys of its own rows only
        updates = {int(k): 10.0 + r for b in batches for k in b.keys}
        client.mutate_priorities("p", updates)
        updated.update(updates)
    slots = {int(k): int(np.flatnonzero(table.meta.key == k)[0]) for k in updated}
    for key, priority in updated.items():
        assert table.meta.priority[slots[key]] == priority
    table.mutate_priorities({key: 0.5 + (key % 7) for key in range(1, 41)})  # as the module's other tests expect


def test_a_dataset_rank_reads_ahead_its_rows(daemon):
    reference = world_one(daemon, "u", 2 * B, seed=3, steps=3)
    got: dict[int, list] = {}

    def rank(r: int) -> None:
        with reverb.TrajectoryDataset(daemon.address(), "u", batch_size=B, max_samples=3 * B, planes=["shm"],
                                      rank=r, world_size=2, seed=3) as ds:
            got[r] = list(ds.batches())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_rows_of(reference, got, 2)


def test_a_rank_that_never_comes_costs_bounded_memory_and_its_steps_expire():
    d = start_daemon(table_config("t", 64), lease_timeout_s=1.0, reap_interval_s=0.1)
    try:
        fill(d.tables["t"], 16, length=8, dim=16)
        groups: GroupRegistry = d.manager.groups
        groups.max_pending_steps = 8
        with PlaneSampler(d.address(), "t", planes=["shm"], rank=0, world_size=2, seed=1) as alone:
            for _ in range(50):
                alone.sample(B)
                assert groups.pending_steps() <= 8  # rank 1's slices of at most 8 steps wait for it
                assert d.tables["t"].active_leases() <= 8
            with PlaneSampler(d.address(), "t", planes=["shm"], rank=1, world_size=2, seed=1) as late:
                with pytest.raises(ValueError, match="step 0 .* is gone"):
                    late.sample(B)  # dropped: refused, never another selection under that step
            deadline = time.monotonic() + 10
            while groups.pending_steps() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert groups.pending_steps() == 0 and d.tables["t"].active_leases() == 0  # expired, released
        assert len(groups) == 0
    finally:
        d.stop()


def test_bad_groups_are_refused(daemon):
    with pytest.raises(ValueError, match="rank 2 is not in"):
        PlaneSampler(daemon.address(), "u", rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank given without world_size"):
        PlaneSampler(daemon.address(), "u", rank=1)
    with PlaneSampler(daemon.address(), "u", planes=["shm"], rank=0, world_size=2, seed=4, group_id="g") as first:
        first.open()
        with pytest.raises(ValueError, match="world_size 2 and seed 4; this rank asked for 3 and 4"):
            PlaneSampler(daemon.address(), "u", planes=["shm"], rank=1, world_size=3, seed=4, group_id="g").open()
        with PlaneSampler(daemon.address(), "u", planes=["shm"], rank=0, world_size=2, seed=4,
                          group_id="g") as twin:
            first.sample(B)
            with pytest.raises(ValueError, match="taken already"):
                twin.sample(B)  # two ranks with one rank number
    with pytest.raises(ValueError, match="needs the shm or rdma plane"):
        PlaneSampler(daemon.address(), "u", planes=["inline"], rank=0, world_size=2, seed=4).sample(B)


def test_the_docs_recipe_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "DATA_PLANES.md").read_text()
    code = re.search(r"<!-- recipe: ranks -->\n```python\n(.*?)^```", text, re.S | re.M).group(1)
    script = tmp_path / "recipe.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['action', 'reward']"


def test_a_rank_waiting_for_a_step_whose_maker_left_makes_it_itself():
    d = start_daemon(table_config("t", 64))
    try:
        maker = PlaneSampler(d.address(), "t", planes=["shm"], rank=0, world_size=2, seed=9)
        waiter = PlaneSampler(d.address(), "t", planes=["shm"], rank=1, world_size=2, seed=9)
        maker.open()
        waiter.open()
        outcome: dict[str, object] = {}

        def run(name, sampler):
            try:
                outcome[name] = sampler.sample(B)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome[name] = exc

        first = threading.Thread(target=run, args=("maker", maker))
        first.start()  # the table is empty: the maker waits on the rate limiter
        deadline = time.monotonic() + 10
        while not d.manager.groups.pending_steps() and time.monotonic() < deadline:
            time.sleep(0.01)
        second = threading.Thread(target=run, args=("waiter", waiter))
        second.start()
        time.sleep(0.3)
        maker.close()  # its Select ends while it was making step 0
        first.join(10)
        fill(d.tables["t"], 8, length=8, dim=16)
        second.join(20)
        batch = outcome["waiter"]
        assert not isinstance(batch, BaseException), batch
        assert len(batch) == B and check_batch(batch) == B
        waiter.close()
        assert d.manager.groups.pending_steps() == 0 and d.tables["t"].active_leases() == 0
    finally:
        d.stop()


def test_rank_and_world_size_are_read_from_an_initialised_torch_distributed(monkeypatch, daemon):
    """How the rank is looked up (torch itself is not installed here: a module with torch.distributed's
    four functions stands in; the default venv must never import torch)."""
    import types

    from gear_client.data_planes.ranks import selection_group

    dist = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 1,
                                 get_world_size=lambda: 4)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(distributed=dist))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    group = selection_group("t", seed=3)
    assert (group.rank, group.world_size, group.seed, group.group_id) == (1, 4, 3, "torch:10.0.0.1:29500")
    assert selection_group("t", rank=0, world_size=2, seed=3).world_size == 2  # given arguments win
    with PlaneSampler(daemon.address(), "u") as dataset_sampler:
        assert dataset_sampler.group.world_size == 4  # what the datasets use
    client = reverb.Client(daemon.address())
    next(client.sample("u", 1))
    assert client._planes["u"].group is None  # Reverb's API samples on its own, as Reverb's does
    dist.is_initialized = lambda: False
    assert selection_group("t") is None  # not initialised: a learner on its own, as in Reverb


def test_ranks_on_the_rdma_plane_get_their_rows_too():
    """Each rank "on another host" reads its rows over (emulated) RDMA; the world 1 reference over shm."""
    from tests.support.rdma_emulation import EmulatedConnection, EmulatedRdmaServer

    d = start_daemon(prioritized("p"), rdma=EmulatedRdmaServer())
    try:
        fill(d.tables["p"], 40, length=8, dim=16)
        d.tables["p"].mutate_priorities({key: 0.5 + (key % 7) for key in range(1, 41)})
        reference = world_one(d, "p", 2 * B, seed=17)
        per_rank = ranks(d, "p", 2, seed=17, host_id="learner-on-another-host",
                         rdma_connection=lambda: EmulatedConnection(num_qps=2), planes_override=["rdma"])
        assert_rows_of(reference, per_rank, 2)
    finally:
        d.stop()
