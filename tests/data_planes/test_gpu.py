"""The shm plane into GPU memory (the gather kernel over the registered segment), and device batches.

Skipped without CuPy and a CUDA GPU (never faked).
"""

from __future__ import annotations

import numpy as np
import pytest

import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from gear_client.data_planes.shm import ShmPlane
from gear_kernels import Window, gpu_available
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import ACTION, check_batch, fill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(table_config("t", 64))
    fill(d.tables["t"], 40, length=64, dim=1024)
    fill(d.tables["t"], 8, start=500, length=20, dim=1024)  # shorter items: padding matters
    yield d
    d.stop()


class HostView:
    """A SampledBatch's columns copied to the host, for the checks."""

    def __init__(self, batch):
        self.columns = [c.get() for c in batch.columns]
        self.lengths, self.keys = batch.lengths, batch.keys

    def __len__(self) -> int:
        return len(self.keys)


def test_sampler_on_a_gpu_gathers_into_device_memory(daemon):
    import cupy as cp

    with PlaneSampler(daemon.address(), "t", device="cuda") as s:
        batch = s.sample(32)
        assert s.kind == "shm" and all(isinstance(c, cp.ndarray) for c in batch.columns)
        assert batch.columns[1].shape == (32, 64, 1024) and batch.columns[1].dtype == cp.float32
        assert check_batch(HostView(batch)) == 32


def test_pipelined_gpu_batches_of_several_per_select_are_intact_views_of_one_gather(daemon):
    import cupy as cp

    with PlaneSampler(daemon.address(), "t", device="cuda") as s:
        stream = s.batches(8, batches_per_select=4)
        batches = [next(stream) for _ in range(12)]
        stream.close()
        assert s.selects <= 6  # 12 batches, 4 per Select (and the Selects sent ahead)
    for b in batches:
        assert isinstance(b.columns[1], cp.ndarray) and b.columns[1].shape == (8, 64, 1024)
        assert check_batch(HostView(b)) == 8
    assert daemon.tables["t"].active_leases() == 0


@pytest.mark.parametrize("window", [None, Window(16, -16), Window(40, 0, "head"), Window(80, 0)])
def test_gpu_and_cpu_gathers_of_one_selection_agree(daemon, window):
    with PlaneSampler(daemon.address(), "t", planes=["shm"]) as s:
        s.open()
        layout = s._layout
        selection = s._session.select(24, len(layout.columns), None)
        cpu = ShmPlane(None, layout).fetch(selection, window)
        gpu_plane = ShmPlane(None, layout, device="cuda:0")
        gpu = gpu_plane.fetch(selection, window)
        s._session.release([selection.lease_id])
        for a, b in zip(cpu.columns, gpu.columns, strict=True):
            assert a.shape == b.shape and np.array_equal(a, b.get())
        assert np.array_equal(cpu.lengths, gpu.lengths)
        gpu_plane.close()


def test_dataset_on_a_gpu_yields_device_arrays_without_copies(daemon):
    import cupy as cp

    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=16, device="cuda", max_samples=32) as ds:
        batches = list(ds.batches())
    assert len(batches) == 2 and ds.plane == "shm"
    obs = batches[0].columns[1]
    assert isinstance(obs, cp.ndarray)
    assert cp.from_dlpack(obs).data.ptr == obs.data.ptr  # DLPack hands over the same memory
    for b in batches:
        check_batch(HostView(b))


def test_torch_output_shares_the_gathered_memory(daemon):
    torch = pytest.importorskip("torch")
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=8, device="cuda", output="torch",
                                  max_samples=8) as ds:
        (batch,) = list(ds.batches())
    obs = batch.columns[1]
    assert isinstance(obs, torch.Tensor) and obs.is_cuda and tuple(obs.shape) == (8, 64, 1024)
    action = batch.columns[ACTION].cpu().numpy()
    assert np.array_equal(action[:, 0].astype(np.uint64), batch.keys)


def test_inline_batches_are_moved_to_the_gpu_when_asked(daemon):
    import cupy as cp

    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=8, device="cuda", planes=["inline"],
                                  max_samples=8) as ds:
        (batch,) = list(ds.batches())
    assert batch.plane == "inline" and isinstance(batch.columns[1], cp.ndarray)
    assert check_batch(HostView(batch)) == 8
