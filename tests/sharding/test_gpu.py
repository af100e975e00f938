"""A sharded batch assembled in GPU memory: shm parts (CuPy) and inline parts (NumPy) in one device batch,
on the consumer's own stream, ordered with the learner's stream by events."""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.sharding.assembly import assemble
from gear_kernels import gpu_available
from tests.support.sampled_batches import batch_chunk, batch_part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")]


def test_parts_from_two_planes_become_one_device_batch():
    import cupy as cp

    on_gpu = batch_part([1, 2], 3, "shm")
    on_gpu.columns = [cp.asarray(c) for c in on_gpu.columns]
    batch = assemble([on_gpu, batch_part([3, 4, 5], 5, "inline")], np.random.default_rng(0), device="cuda")
    flag, obs = batch.columns
    assert isinstance(obs, cp.ndarray) and obs.shape == (5, 5, 2)
    obs, flag = cp.asnumpy(obs), cp.asnumpy(flag)
    for i, key in enumerate(batch.keys.tolist()):
        steps = int(batch.lengths[i, 1])
        assert flag[i] == key and np.all(obs[i, :steps] == key) and np.all(obs[i, steps:] == 0)


SPIN_CU = r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)ns);
}
"""


def spin(stream, seconds: float = 0.2):
    """Keep ``stream`` busy for about ``seconds`` (one thread watching the GPU's clock)."""
    import cupy as cp

    with stream:
        cp.RawKernel(SPIN_CU, "spin")((1,), (1,), (np.int64(seconds * 1e9),))


def _device_chunk(first_key, n, steps):
    import cupy as cp

    chunk = batch_chunk(first_key, n, steps)
    chunk.columns = [cp.asarray(c) for c in chunk.columns]
    return chunk


def _check(batch, expected_keys):
    import cupy as cp

    keys = batch.keys.astype(np.int64)
    assert sorted(keys.tolist()) == sorted(expected_keys)
    flag, obs = (cp.asnumpy(c) for c in batch.columns)
    np.testing.assert_array_equal(flag, keys)
    np.testing.assert_allclose(batch.probabilities, keys / 1000.0)
    for i, key in enumerate(keys.tolist()):
        steps = int(batch.lengths[i, 1])
        assert np.all(obs[i, :steps] == key) and np.all(obs[i, steps:] == 0)
    return keys


def test_chunk_views_and_host_pieces_in_one_launch_on_a_learners_stream():
    """Views of device chunks and a host piece, rows shuffled and whole; the batch is in the current stream's order."""
    import cupy as cp

    from gear_client.sharding.assembly import DeviceAssembly, rows

    a, b = _device_chunk(100, 8, 4), _device_chunk(200, 8, 6)
    host = batch_chunk(300, 5, 3)
    context = DeviceAssembly("cuda")
    learner = cp.cuda.Stream(non_blocking=True)
    with learner:
        batch = assemble([rows(a, 3, 8), rows(b, 0, 2), host, rows(b, 2, 8)], np.random.default_rng(1), "cuda",
                         context)
        assert batch.columns[1].shape == (18, 6, 2)  # 5 + 2 + 5 + 6 rows
        keys = _check(batch, [*range(103, 108), *range(200, 208), *range(300, 305)])
        assert np.flatnonzero(keys < 200).tolist() != list(range(5))  # not at fixed rows
    context.synchronize()


def test_many_pieces_strided_device_views_and_global_probabilities_in_one_launch():
    """A dozen pieces (strided device views among them, copied contiguous first) in one batch; the global
    probabilities and size given to assemble() replace the pieces' own, row for row."""
    import cupy as cp

    from gear_client.sharding.assembly import DeviceAssembly, rows

    pieces, expected = [], []
    for k in range(12):
        chunk = _device_chunk(100 * (k + 1), 6, 3 + k % 4)
        if k % 3 == 0:  # steps cut from a wider column: rows are not contiguous
            wide = cp.zeros((6, 8, 2), cp.float32)
            wide[:, :chunk.columns[1].shape[1]] = chunk.columns[1]
            chunk.columns[1] = wide[:, :chunk.columns[1].shape[1]]
            assert not chunk.columns[1].flags.c_contiguous
        pieces.append(rows(chunk, k % 2, 6))
        expected.extend(range(100 * (k + 1) + k % 2, 100 * (k + 1) + 6))
    context = DeviceAssembly("cuda")
    flat_keys = np.concatenate([p.keys for p in pieces]).astype(np.int64)
    for p in pieces:
        p.probabilities = np.zeros(len(p))  # the shard's own: replaced by the global ones below
    batch = assemble(pieces, np.random.default_rng(3), "cuda", context, probabilities=flat_keys / 1000.0,
                     table_size=4321)
    assert batch.columns[1].shape == (len(expected), 6, 2)
    _check(batch, expected)
    assert set(batch.table_sizes.tolist()) == {4321}
    context.synchronize()


def test_assembly_waits_for_the_learners_reads_before_reusing_their_memory():
    """The learner queues a slow read of a batch and drops it: later assemblies (which may reuse that memory)
    write only after the read, without a host wait."""
    import cupy as cp

    from gear_client.sharding.assembly import DeviceAssembly

    context = DeviceAssembly("cuda")
    pieces = [_device_chunk(10, 16, 64), _device_chunk(40, 16, 64)]
    later = [_device_chunk(1000 + 100 * i, 16, 64) for i in range(2)]  # on the device before the step
    batch = assemble(pieces, np.random.default_rng(0), "cuda", context)
    expected = batch.keys.astype(np.int64)
    spin(cp.cuda.Stream.null, 0.3)  # the learner's step, still running while the next batches are assembled
    copy = batch.columns[1].copy()  # queued on the learner's stream after the step
    del batch
    for k in range(4):
        assemble(later, np.random.default_rng(k + 1), "cuda", context)
    got = cp.asnumpy(copy)
    for i, key in enumerate(expected.tolist()):
        assert np.all(got[i] == key), f"row {i} was overwritten before the learner read it"
    context.synchronize()


def test_assembly_runs_while_other_streams_are_busy():
    """Nothing of the assembly waits for work on other streams (the shards' gathers read ahead)."""
    import cupy as cp

    from gear_client.sharding.assembly import DeviceAssembly

    context = DeviceAssembly("cuda")
    pieces = [_device_chunk(10, 4, 4), _device_chunk(20, 4, 4)]
    assemble(pieces, np.random.default_rng(0), "cuda", context)  # compiled, warm
    gather = cp.cuda.Stream(non_blocking=True)
    spin(gather, 1.0)
    busy = cp.cuda.Event()
    busy.record(gather)
    batch = assemble(pieces, np.random.default_rng(1), "cuda", context)
    _check(batch, [*range(10, 14), *range(20, 24)])  # on the null stream, after the assembly
    assert not busy.done, "the assembly waited for another stream"
    gather.synchronize()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.support.shard_cluster import Cluster

    c = Cluster(tmp_path_factory.mktemp("gpushards"))
    yield c
    c.stop()


def test_dataset_over_three_shards_into_gpu_memory(cluster):
    """Shard 0 (this host) gathered by the GPU kernel, shards 1 and 2 over streams, one CuPy batch, items intact."""
    import cupy as cp

    import gear_client as reverb
    from tests.support.shard_cluster import ITEM_DIM, ITEM_STEPS
    from tests.support.trajectories import ACTION, item_ok, make_item

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
        assert kinds[cluster.addresses[0]] == "shm" and kinds[cluster.addresses[1]] == "stream"
