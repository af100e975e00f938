"""The nixl plane into GPU memory: the learner's agent READs the leased windows into a CuPy buffer (VRAM).

Needs NIXL (``make test-nixl`` venv, or the GPU machine's ``GPU_SITE`` with the
repacked nixl-cu13 wheel of ``make gpu-wheels``), CuPy and a CUDA GPU; skipped
otherwise. UCX moves the bytes over TCP on loopback, staged into the GPU with
cuda_copy where there is no GPUDirect path.
"""

from __future__ import annotations

import numpy as np
import pytest

from gear_contract import nixl_agents
from gear_kernels import gpu_available
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.sampled_batches import HostView
from tests.support.trajectories import Churn, check_batch, fill

pytestmark = [pytest.mark.gpu, pytest.mark.nixl,
              pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU"),
              pytest.mark.skipif(nixl_agents.unavailable_reason() is not None,
                                 reason=f"{nixl_agents.unavailable_reason()} (make test-nixl / gpu-wheels)")]


@pytest.fixture(autouse=True)
def ucx_over_loopback(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def test_a_gpu_learner_reads_over_nixl_straight_into_device_memory_under_churn():
    import cupy as cp

    from gear_client.data_planes.sampler import PlaneSampler

    d = start_daemon(table_config("t", 32), nixl=True)
    try:
        table = d.tables["t"]
        fill(table, 24, length=32, dim=2048)  # 256 KiB items
        fill(table, 8, start=500, length=20, dim=2048)  # shorter ones: their padding must be zeros
        with PlaneSampler(d.address(), "t", planes=["nixl", "inline"], device="cuda") as s, \
                Churn(table, length=32, dim=2048) as churn:
            assert s.open() == "nixl"
            plane = s._reader
            assert plane.gpu
            batch = s.sample(16)
            assert all(isinstance(c, cp.ndarray) for c in batch.columns) and batch.plane == "nixl"
            assert check_batch(HostView(batch)) == 16
            obs = batch.columns[1].get()
            for i in range(len(batch)):
                n = int(batch.lengths[i, 1])
                assert not np.any(obs[i, n:]), "padding past an item's length is not zeroed"
            checked = 0
            for b in s.batches(8):
                checked += check_batch(HostView(b))
                if checked >= 200:
                    break
            assert s._reader is plane and plane.transfers >= 2
        assert churn.inserted > 0
    finally:
        d.stop()
