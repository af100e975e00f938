"""The device tier on real GPUs: the mirror in device memory, opened through CUDA IPC, read from peer GPUs.

Skipped without CuPy and a CUDA GPU (never faked); the peer test needs two GPUs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_kernels import gpu_available
from gear_server.table.gpu_mirror import MirrorRefused
from tests.support.paths import ROOT
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import Churn, fill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")]

LENGTH, DIM = 16, 1024  # about 66 KiB per item


def gpu_count() -> int:
    if not gpu_available():
        return 0
    import cupy as cp

    return cp.cuda.runtime.getDeviceCount()


def mirrored(max_size: int, rows: int | None = None, budget: int | None = None) -> pb.TableConfig:
    config = table_config("t", max_size)
    row = 128 + LENGTH * DIM * 4 + 128  # int64 action, float32 obs, float32 reward rows, 128-byte aligned
    config.gpu_mirror.CopyFrom(pb.GpuMirror(device=0, bytes=budget or rows * row, backend="cuda"))
    return config


def learner(port: int, batches: int, device: int | None = None, mode: str = "reader") -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-m", "tests.support.device_learner", mode, f"localhost:{port}", "t", str(batches)]
    out = subprocess.run(args + ([str(device)] if device is not None else []), env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_mirror_matches_the_segment_element_for_element_under_insert_churn():
    """Every mirrored row a leased selection is given equals its slot's row in the segment, checked on the GPU."""
    import cupy as cp

    daemon = start_daemon(mirrored(64, rows=48))
    try:
        table = daemon.tables["t"]
        fill(table, 64, length=LENGTH, dim=DIM)
        assert table.mirror.flush(10)
        mirror = table.mirror.rows_buffer
        checked = differ = 0
        deadline = time.monotonic() + 5
        with Churn(table, length=LENGTH, dim=DIM):
            while time.monotonic() < deadline:
                selection = table.sample(32)
                size = table.layout().columns[0].slot_stride
                rows = table.mirror.rows_for(selection.slots, selection.generations, size)
                hit = rows >= 0
                with cp.cuda.Device(0):
                    gathered = cp.take(mirror.device_array()[: (mirror.nbytes // size) * size].reshape(-1, size),
                                       cp.asarray(rows[hit]), axis=0)
                    segment = np.frombuffer(table.segment.buffer, np.uint8)[: table.capacity * size]
                    expected = cp.asarray(segment.reshape(-1, size)[selection.slots[hit]])
                    differ += int(cp.count_nonzero(cp.any(gathered != expected, axis=1)))
                checked += int(hit.sum())
                table.release(selection.lease_id)
        assert differ == 0
        assert checked > 100
    finally:
        daemon.stop()


def test_ipc_open_from_another_process_under_churn():
    daemon = start_daemon(mirrored(64, rows=48))
    try:
        table = daemon.tables["t"]
        fill(table, 64, length=LENGTH, dim=DIM)
        assert table.mirror.flush(10)
        with Churn(table, length=LENGTH, dim=DIM):
            result = learner(daemon.port, 200, device=0)
        assert result["bad"] == 0 and result["bytes_differ"] == 0
        assert result["items"] >= 16 * 150 and result["mirrored"] > 0
    finally:
        daemon.stop()


def test_plane_sampler_into_gpu_memory_negotiates_the_device_plane():
    """PlaneSampler(device="cuda") in another process reads the mirror (and the segment for the rest) under churn."""
    daemon = start_daemon(mirrored(64, rows=40))  # 40 of the 64 items mirrored: batches mix both sources
    try:
        table = daemon.tables["t"]
        fill(table, 64, length=LENGTH, dim=DIM)
        assert table.mirror.flush(10)
        with Churn(table, length=LENGTH, dim=DIM):
            result = learner(daemon.port, 100, device=0, mode="sampler")
        assert result == {"kind": "device", "items": 1600}
    finally:
        daemon.stop()


@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (peer reads)")
def test_peer_gpu_reads_the_mirror():
    daemon = start_daemon(mirrored(64, rows=64))
    try:
        table = daemon.tables["t"]
        fill(table, 64, length=LENGTH, dim=DIM)
        assert table.mirror.flush(10)
        result = learner(daemon.port, 50, device=1)
        assert result["bad"] == 0 and result["bytes_differ"] == 0
        assert result["mirrored"] == result["items"] == 16 * 50  # the whole table is mirrored
    finally:
        daemon.stop()


def test_a_budget_the_gpu_cannot_hold_is_refused_at_start():
    import cupy as cp

    _, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(MirrorRefused, match="lower gpu_mirror bytes"):
        start_daemon(mirrored(64, budget=2 * total))
    with pytest.raises(MirrorRefused, match="does not exist"):
        config = mirrored(64, rows=4)
        config.gpu_mirror.device = gpu_count()
        start_daemon(config)


def test_the_docs_recipe_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "DATA_PLANES.md").read_text()
    code = re.search(r"<!-- recipe: device -->\n```python\n(.*?)^```", text, re.S | re.M).group(1)
    script = tmp_path / "recipe.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(32, 1, 64, 1024) True"
