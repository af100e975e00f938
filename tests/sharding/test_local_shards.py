"""One table over two daemons on this host, both read over shm: the batch assembled from both, on the CPU
and (marked gpu) in GPU memory; items checksummed, padding past the shorter shard's items zero."""

from __future__ import annotations

import numpy as np
import pytest

import gear_client as reverb
from gear_kernels import gpu_available
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import ACTION, fill, item_ok

pytestmark = pytest.mark.timeout(120)
GPU = pytest.param("cuda", marks=[pytest.mark.gpu,
                                  pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")])


@pytest.fixture(scope="module")
def daemons():
    ds = [start_daemon(table_config("t", 64)) for _ in range(2)]
    try:
        fill(ds[0].tables["t"], 24, start=1, length=32, dim=256)
        fill(ds[1].tables["t"], 24, start=1000, length=20, dim=256)  # shorter items: padded to 32 in a batch
        yield ds
    finally:
        for d in ds:
            d.stop()


@pytest.mark.parametrize("device", [None, GPU])
def test_two_same_host_shards_read_ahead_into_one_batch(daemons, device):
    host = (lambda c: c.get()) if device else np.asarray
    with reverb.TrajectoryDataset([d.address() for d in daemons], "t", batch_size=32, max_samples=32 * 20,
                                  device=device, sampler_options={"seed": 7}) as ds:
        shards, batches = set(), 0
        for batch in ds.batches():
            action, obs, reward = (host(c) for c in batch.columns)
            assert obs.shape == (32, 32, 256)
            for i in range(len(batch)):
                n = int(batch.lengths[i, ACTION])
                assert item_ok(action[i, :n], obs[i, :n], reward[i, :n]) and int(action[i, 0]) == batch.keys[i]
                assert n == (32 if batch.keys[i] < 1000 else 20) and not obs[i, n:].any()
                shards.add(int(batch.keys[i]) >= 1000)
            assert set(batch.table_sizes.tolist()) == {48}
            batches += 1
        assert batches == 20 and shards == {False, True} and ds.plane == "shm"
