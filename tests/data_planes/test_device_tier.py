"""The device plane against a real daemon, its GPU mirror in the host-memory stand-in (no GPU needed).

A learner offering ``device`` on the daemon's host gets a device session; each
Select lists the items' mirror rows; one gather takes the mirrored items from
the mirror and the others from the segment; every item is checked against its
checksum, also from another process while inserts churn the table. The TOML
and the Python ``Server`` option reach the daemon; a mirror shows in
``server_info`` and the metrics; bad options are refused with their name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import grpc
import numpy as np
import pytest

import gear_client
from gear_client.data_planes.device import DeviceTierReader, columns
from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.config import ConfigError, parse_config
from tests.support.daemon_process import DaemonProcess
from tests.support.metrics_text import scrape, value
from tests.support.paths import ROOT
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.ports import free_port
from tests.support.trajectories import Churn, fill, item_ok

LENGTH, DIM = 8, 64  # items of 8 steps of 64 float32 (+ action and reward)
ROW = 128 + 8 * DIM * 4 + 128  # their slot row: int64 action, float32 obs, float32 reward, each 128-byte aligned


def mirrored(name: str = "t", max_size: int = 64, budget: int = 8 << 20) -> pb.TableConfig:
    config = table_config(name, max_size)
    config.gpu_mirror.CopyFrom(pb.GpuMirror(device=0, bytes=budget, backend="host"))
    return config


def checked(rows: np.ndarray, reader: DeviceTierReader, selection) -> int:
    """How many items of a gathered batch fail their checksum."""
    action, obs, reward = columns(rows, reader.layout)
    bad = 0
    for i in range(len(selection)):
        n = int(selection.lengths[i, 0])
        bad += not item_ok(action[i, :n], obs[i, :n], reward[i, :n])
        bad += int(action[i, 0]) != int(selection.infos[0][i])  # the item is the key's
    return bad


def stub_of(daemon):
    channel = grpc.insecure_channel(f"localhost:{daemon.port}")
    return channel, pb_grpc.ReplayServiceStub(channel)


def test_device_session_reads_mirror_and_segment_in_one_batch():
    daemon = start_daemon(mirrored(budget=16 * ROW))  # the 16 most recent of 40 items
    channel, stub = stub_of(daemon)
    try:
        table = daemon.tables["t"]
        fill(table, 40, length=LENGTH, dim=DIM)
        assert table.mirror.flush(5)
        assert table.layout().columns[0].slot_stride == ROW and table.info().gpu_mirror.mirrored_items == 16
        with DeviceTierReader(stub, "t") as reader:
            assert reader.session.kind == negotiation.DEVICE and not reader.on_gpu
            hits = misses = 0
            for _ in range(10):
                selection = reader.select(32)
                batch = reader.gather(selection)
                assert batch.shape == (32, ROW)
                assert checked(batch, reader, selection) == 0
                hits += int((selection.mirror_rows >= 0).sum())
                misses += int((selection.mirror_rows < 0).sum())
                assert reader.release(selection)
        assert hits > 0 and misses > 0
    finally:
        channel.close()
        daemon.stop()


def test_a_learner_without_device_gets_shm_and_an_unmirrored_table_no_device_session():
    daemon = start_daemon(mirrored("m"), table_config("plain"))
    channel, stub = stub_of(daemon)
    try:
        host = negotiation.local_host_id()
        shm = stub.OpenDataPlane(pb.OpenDataPlaneRequest(table="m", offer=pb.DataPlaneOffer(host_id=host, shm=True)))
        assert shm.kind == negotiation.SHM and not shm.HasField("device_tier")
        with pytest.raises(RuntimeError, match="no gpu_mirror"):
            DeviceTierReader(stub, "plain")
        remote = stub.OpenDataPlane(pb.OpenDataPlaneRequest(
            table="m", offer=pb.DataPlaneOffer(host_id="elsewhere", shm=True, device=True, inline=True)))
        assert remote.kind == negotiation.INLINE  # another host never gets the device plane
    finally:
        channel.close()
        daemon.stop()




def test_no_torn_item_from_another_process_under_insert_churn():
    daemon = start_daemon(mirrored(max_size=32, budget=24 * ROW))
    try:
        table = daemon.tables["t"]
        fill(table, 32, length=LENGTH, dim=DIM)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with Churn(table, length=LENGTH, dim=DIM):
            out = subprocess.run([sys.executable, "-m", "tests.support.device_learner", "reader",
                                  f"localhost:{daemon.port}", "t", "150"], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["bad"] == 0
        assert result["items"] >= 16 * 100 and result["mirrored"] > 0 and result["bytes_differ"] == 0
    finally:
        daemon.stop()


def test_toml_mirror_shows_in_server_info_and_metrics(tmp_path):
    port = free_port()
    config = f"""
instance_name = "tier{uuid.uuid4().hex[:8]}"
bind_address = "127.0.0.1"
port = 0
[[tables]]
name = "t"
max_size = 100
sampler = "uniform"
remover = "fifo"
rate_limiter = {{ min_size = 1 }}
gpu_mirror = {{ device = 0, bytes = "2MiB", backend = "host" }}
[metrics]
bind = "127.0.0.1"
port = {port}
"""
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.wait_ready()
        client = gear_client.Client(daemon.address)
        for i in range(5):
            client.insert([np.full(16, i, np.float32)], {"t": 1.0})
        info = client.server_info()["t"].gpu_mirror
        assert info.budget_bytes == 2 << 20 and info.device == 0 and info.rows > 0
        scraped = scrape(port)
        assert value(scraped, "gear_gpu_mirror_bytes", table="t", device="0") == 2 << 20
        assert value(scraped, "gear_gpu_mirror_items", table="t", device="0") <= 5
    finally:
        assert daemon.stop() == 0


def test_a_checkpoint_restores_into_the_configured_mirror(tmp_path):
    """The checkpoint keeps the table's items and selector config; the mirror is the configured one."""
    def config(budget: str) -> str:
        return f"""
instance_name = "tier{uuid.uuid4().hex[:8]}"
bind_address = "127.0.0.1"
port = 0
[[tables]]
name = "t"
max_size = 100
sampler = "uniform"
remover = "fifo"
rate_limiter = {{ min_size = 1 }}
gpu_mirror = {{ device = 0, bytes = "{budget}", backend = "host" }}
[checkpoint]
dir = "{tmp_path / 'checkpoints'}"
on_stop = false
"""

    first = DaemonProcess(tmp_path, config("1MiB"), "first")
    try:
        first.wait_ready()
        client = gear_client.Client(first.address)
        for i in range(20):
            client.insert([np.full(16, i, np.float32)], {"t": 1.0})
        client.checkpoint()
    finally:
        assert first.stop() == 0
    second = DaemonProcess(tmp_path, config("2MiB"), "second")
    try:
        second.wait_ready()
        client = gear_client.Client(second.address)
        deadline = time.monotonic() + 30
        while client.server_info()["t"].gpu_mirror.mirrored_items < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        info = client.server_info()["t"]
        assert info.current_size == 20
        assert info.gpu_mirror.budget_bytes == 2 << 20 and info.gpu_mirror.mirrored_items == 20
        assert "differs from the configured one" not in second.log  # placement is no config difference
    finally:
        assert second.stop() == 0


def test_server_option_reaches_the_daemon():
    table = gear_client.Table("t", gear_client.selectors.Uniform(), gear_client.selectors.Fifo(), 10,
                              gear_client.rate_limiters.MinSize(1),
                              gpu_mirror={"device": 0, "bytes": "1MiB", "backend": "host"})
    server = gear_client.Server([table])
    try:
        client = server.localhost_client()
        client.insert([np.zeros(4, np.float32)], {"t": 1.0})
        assert client.server_info()["t"].gpu_mirror.budget_bytes == 1 << 20
    finally:
        server.stop()


def docs_recipe() -> str:
    text = (ROOT / "docs" / "DATA_PLANES.md").read_text()
    return re.search(r"<!-- recipe: device -->\n```python\n(.*?)^```", text, re.S | re.M).group(1)


def run_recipe(code: str, folder) -> str:
    script = folder / "recipe.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_docs_recipe_runs_on_the_host_stand_in(tmp_path):
    """The recipe as written needs a GPU (test_device_tier_gpu.py runs it); here with backend "host"."""
    code = docs_recipe()
    assert code.count('"bytes": "1GiB"}') == 1
    assert run_recipe(code.replace('"bytes": "1GiB"}', '"bytes": "1GiB", "backend": "host"}'),
                      tmp_path) == "(32, 1, 64, 1024) True"


@pytest.mark.parametrize(("mirror", "message"), [
    ('{ device = 0 }', "bytes .* is required"),
    ('{ device = 0, bytes = "lots" }', "byte size"),
    ('{ device = -1, bytes = "1GiB" }', "device must be"),
    ('{ device = 0, bytes = "1GiB", backend = "tpu" }', "backend must be"),
    ('{ device = 0, bytes = "1GiB", colour = 1 }', "colour"),
    ('"8GiB"', "must be a table"),
])
def test_bad_toml_mirror_is_refused_naming_the_key(mirror, message):
    import tomllib

    doc = tomllib.loads(f'[[tables]]\nname = "t"\nmax_size = 4\nsampler = "uniform"\nremover = "fifo"\n'
                        f'rate_limiter = {{ min_size = 1 }}\ngpu_mirror = {mirror}\n')
    with pytest.raises(ConfigError, match=message):
        parse_config(doc)


def test_byte_sizes():
    import tomllib

    def budget(text: str) -> int:
        doc = tomllib.loads(f'[[tables]]\nname = "t"\nmax_size = 4\nsampler = "uniform"\nremover = "fifo"\n'
                            f'rate_limiter = {{ min_size = 1 }}\ngpu_mirror = {{ bytes = {text} }}\n')
        return parse_config(doc).server.tables[0].gpu_mirror.bytes

    assert budget('"8GiB"') == 8 << 30
    assert budget('"512 MiB"') == 512 << 20
    assert budget('"2GB"') == 2 * 10**9
    assert budget("4096") == 4096


def test_server_option_refuses_a_bad_mirror():
    with pytest.raises(ValueError, match="gpu_mirror bytes"):
        gear_client.Table("t", gear_client.selectors.Uniform(), gear_client.selectors.Fifo(), 10,
                          gear_client.rate_limiters.MinSize(1), gpu_mirror={"device": 0, "bytes": "-3"})


@pytest.mark.skipif(__import__("gear_kernels").gpu_available(), reason="this machine has a GPU")
def test_a_cuda_mirror_without_a_gpu_is_refused_at_start(tmp_path):
    config = f"""
instance_name = "tier{uuid.uuid4().hex[:8]}"
bind_address = "127.0.0.1"
port = 0
[[tables]]
name = "t"
max_size = 100
sampler = "uniform"
remover = "fifo"
rate_limiter = {{ min_size = 1 }}
gpu_mirror = {{ device = 0, bytes = "1GiB" }}
"""
    daemon = DaemonProcess(tmp_path, config)
    try:
        assert daemon.process.wait(timeout=60) == 1  # could not start (not a configuration error)
        assert "gpu_mirror needs CuPy and a CUDA GPU" in daemon.log
    finally:
        daemon.close()


def test_windows_of_a_batch_part_keep_their_items_starts():
    """A device batch is gathered in two parts (mirror, segment): per-item window starts follow their items."""
    from gear_client.data_planes.device import windows_of
    from gear_kernels import Window

    windows = [Window(4, np.arange(5), "head"), Window(2, -1)]
    part = windows_of(windows, np.array([True, False, True, False, True]))
    assert part[0].start.tolist() == [0, 2, 4] and (part[0].length, part[0].pad) == (4, "head")
    assert part[1] is windows[1]
