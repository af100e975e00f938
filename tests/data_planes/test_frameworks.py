"""Datasets in PyTorch and JAX training loops (marker ``torch`` / ``jax``: skipped where not installed).

``make test-frameworks`` runs them in ``.venv-frameworks`` (torch CPU and jax); the
default ``.venv`` has neither, and there the datasets must not import them.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys

import numpy as np
import pytest

import gear_client as reverb
from tests.support.plane_daemon import queue_config, start_daemon, table_config
from tests.support.trajectories import check_batch, fill

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(table_config("t", 64), queue_config("queue", 64))
    fill(d.tables["t"], 32, length=8, dim=16)
    yield d
    d.stop()


def test_a_dataset_pickles_as_its_address_and_options_and_starts_where_it_is_iterated(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=8, window=8) as ds:
        data = pickle.dumps(ds)
        assert len(data) < 2048 and b"grpc" not in data  # options, no channel
    copy = pickle.loads(data)
    assert copy._sampler is None  # nothing opened until it is iterated
    with copy:
        sizes = [check_batch(b) for b in copy.batches()]
        assert copy.plane == "shm"
    assert sizes == [4, 4]
    with reverb.TimestepDataset(daemon.address(), "t", batch_size=2, max_samples=2) as original:
        steps = pickle.loads(pickle.dumps(original))
    with steps:
        (sample,) = list(steps)
    assert sample.data["obs"].shape == (2, 16) and sample.data["action"].shape == (2,)


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed here")
def test_without_torch_the_dataset_is_a_plain_iterator_and_torch_is_not_imported():
    code = ("import sys, gear_client as reverb; "
            "assert reverb.TrajectoryDataset.__mro__[1] is object, reverb.TrajectoryDataset.__mro__; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.torch
def test_the_dataset_is_a_torch_iterable_dataset_in_a_dataloader(daemon):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, IterableDataset

    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=12) as ds:
        assert isinstance(ds, IterableDataset)
        batches = list(DataLoader(ds, batch_size=None))
    assert len(batches) == 3
    for b in batches:
        assert isinstance(b.data["obs"], torch.Tensor) and b.data["obs"].shape == (4, 8, 16)
        assert isinstance(b.info.key, torch.Tensor) and b.info.key.shape == (4,)
        assert torch.equal(b.data["action"][:, 0].to(torch.int64), b.info.key.to(torch.int64))


@pytest.mark.torch
@pytest.mark.parametrize("context", ["spawn", "fork"])
def test_dataloader_workers_each_open_their_own_session(daemon, context):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    ds = reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=24)
    try:
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=60)
        batches = list(loader)
    finally:
        ds.close()
    assert sum(len(b.info.key) for b in batches) == 24  # max_samples split between the workers
    for b in batches:
        action, obs = b.data["action"], b.data["obs"]
        assert isinstance(obs, torch.Tensor) and obs.shape[1:] == (8, 16)
        assert torch.equal(action[:, 0].to(torch.int64), b.info.key.to(torch.int64))
    assert daemon.manager is not None


@pytest.mark.torch
def test_dataloader_workers_on_a_queue_deliver_every_item_once(daemon):
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    table = daemon.tables["queue"]
    fill(table, 16, length=8, dim=16, start=101)
    ds = reverb.TrajectoryDataset(daemon.address(), "queue", batch_size=4, max_samples=16)
    try:
        batches = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=60))
    finally:
        ds.close()
    keys = sorted(k for b in batches for k in b.info.key.tolist())
    assert keys == list(range(101, 117)) and table.size() == 0


@pytest.mark.torch
def test_torch_output_shares_the_batch_memory(daemon):
    torch = pytest.importorskip("torch")
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=4, output="torch") as ds:
        (batch,) = list(ds.batches())
    assert all(isinstance(c, torch.Tensor) for c in batch.columns)
    assert check_batch(batch) == 4  # the checksums hold on the tensors' bytes


@pytest.mark.jax
def test_jax_output_through_dlpack(daemon):
    jax = pytest.importorskip("jax")
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=4, output="jax") as ds:
        (sample,) = list(ds)
    obs = sample.data["obs"]
    assert isinstance(obs, jax.Array) and obs.shape == (4, 8, 16)
    action = np.asarray(sample.data["action"])
    assert np.array_equal(action[:, 0].astype(np.uint64), sample.info.key)
