"""A sharded batch assembled in GPU memory: shm parts (CuPy) and inline parts (NumPy) in one device batch."""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.sharding.assembly import assemble
from gear_kernels import gpu_available

from .test_selection import _part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")]


def test_parts_from_two_planes_become_one_device_batch():
    import cupy as cp

    on_gpu = _part([1, 2], 3, "shm")
    on_gpu.columns = [cp.asarray(c) for c in on_gpu.columns]
    batch = assemble([on_gpu, _part([3, 4, 5], 5, "inline")], np.random.default_rng(0), device="cuda")
    flag, obs = batch.columns
    assert isinstance(obs, cp.ndarray) and obs.shape == (5, 5, 2)
    obs, flag = cp.asnumpy(obs), cp.asnumpy(flag)
    for i, key in enumerate(batch.keys.tolist()):
        steps = int(batch.lengths[i, 1])
        assert flag[i] == key and np.all(obs[i, :steps] == key) and np.all(obs[i, steps:] == 0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ._support import Cluster

    c = Cluster(tmp_path_factory.mktemp("gpushards"))
    yield c
    c.stop()


def test_dataset_over_three_shards_into_gpu_memory(cluster):
    """Shard 0 (this host) gathered by the GPU kernel, shards 1 and 2 inline, one CuPy batch, items intact."""
    import cupy as cp

    import gear_client as reverb
    from tests.data_planes._support import ACTION, item_ok, make_item

    from ._support import ITEM_DIM, ITEM_STEPS

    for shard, address in enumerate(cluster.addresses):
        client = reverb.Client(address)
        for j in range(8):
            item = make_item(100 * shard + j, ITEM_STEPS, ITEM_DIM)
            with client.trajectory_writer(ITEM_STEPS) as writer:
                for t in range(ITEM_STEPS):
                    writer.append({k: v[t] for k, v in item.items()})
                writer.create_item("items", 1.0, {k: writer.history[k][-ITEM_STEPS:] for k in item})
        client.close()
    with reverb.TrajectoryDataset(cluster.addresses, "items", batch_size=16, max_samples=64, device="cuda") as ds:
        seen = 0
        for batch in ds.batches():
            assert all(isinstance(c, cp.ndarray) for c in batch.columns)
            action, obs, reward = (cp.asnumpy(c) for c in batch.columns)
            for i in range(len(batch)):
                n = int(batch.lengths[i, ACTION])
                assert item_ok(action[i, :n], obs[i, :n], reward[i, :n])
            seen += len(batch)
        assert seen == 64
        kinds = ds._sampler.kinds()
        assert kinds[cluster.addresses[0]] == "shm" and kinds[cluster.addresses[1]] == "inline"
