"""A checkpoint restored under a changed TOML: what can apply does; what cannot refuses the start, saying why.

Real daemon processes: one writes a checkpoint on SIGTERM; the next starts from
an edited file.
"""

from __future__ import annotations

import signal
import uuid

import numpy as np

import gear_client
from gear_server.checkpoint.checkpointer import COMPLETE
from tests.support.daemon_process import DaemonProcess, run_daemon

ITEMS = 5


def _config(tmp_path, instance: str, *, max_size: int = 100, min_size: int = 1, sampler: str = "uniform",
            signature: str = 'obs = { dtype = "float32", shape = [4] }') -> str:
    return f'''
bind_address = "127.0.0.1"
port = 0
instance_name = "{instance}"

[[tables]]
name = "replay"
sampler = "{sampler}"
remover = "fifo"
max_size = {max_size}
rate_limiter = {{ min_size = {min_size} }}
[tables.signature]
{signature}

[checkpoint]
dir = "{tmp_path / 'checkpoints'}"
on_stop = true
keep = 1
'''


def _checkpointed(tmp_path, instance: str) -> list:
    daemon = DaemonProcess(tmp_path, _config(tmp_path, instance), "first")
    try:
        daemon.wait_ready()
        client = gear_client.Client(daemon.address)
        for v in range(ITEMS):
            client.insert({"obs": np.full(4, v, np.float32)}, priorities={"replay": 1.0})
        assert daemon.stop(signal.SIGTERM) == 0
    finally:
        daemon.close()
    return sorted((tmp_path / "checkpoints").iterdir())


def test_a_changed_max_size_and_rate_limiter_apply_to_the_restored_items(tmp_path):
    instance = f"cfg{uuid.uuid4().hex[:8]}"
    _checkpointed(tmp_path, instance)
    daemon = DaemonProcess(tmp_path, _config(tmp_path, instance, max_size=300, min_size=3), "changed")
    try:
        daemon.wait_ready()
        info = gear_client.Client(daemon.address).server_info(timeout=30)["replay"]
        assert info.current_size == ITEMS
        assert info.max_size == 300
        assert info.rate_limiter_info.min_size_to_sample == 3
        assert info.rate_limiter_info.insert_stats.completed == ITEMS  # the counters came back
    finally:
        assert daemon.stop() == 0
    assert "the configured max_size (100 -> 300), rate_limiter" in daemon.log, daemon.log
    assert "WARNING" not in daemon.log.split("restored checkpoint")[0], daemon.log


def _refused(tmp_path, config: str, name: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(config)
    before = sorted((p.name, (p / COMPLETE).exists()) for p in (tmp_path / "checkpoints").iterdir())
    result = run_daemon(path)
    assert result.returncode == 2, result.stderr  # a configuration error: the unit does not restart it
    assert sorted((p.name, (p / COMPLETE).exists()) for p in (tmp_path / "checkpoints").iterdir()) == before
    assert "checkpoint written" not in result.stderr and "checkpoint removed" not in result.stderr
    assert f"set these back in {path}" in result.stderr, result.stderr
    assert "set restore = false in [checkpoint]" in result.stderr, result.stderr
    return result.stderr


def test_a_changed_sampler_or_signature_refuses_the_start_naming_each_difference(tmp_path):
    instance = f"cfg{uuid.uuid4().hex[:8]}"
    _checkpointed(tmp_path, instance)
    text = _refused(tmp_path, _config(tmp_path, instance, sampler="lifo",
                                      signature='obs = { dtype = "float64", shape = [4] }'), "changed")
    assert "table 'replay' sampler is lifo in the config, uniform in the checkpoint" in text, text
    assert "signature is {obs float64[4]} in the config, {obs float32[4]} in the checkpoint" in text, text
    text = _refused(tmp_path, _config(tmp_path, instance, max_size=3), "smaller")
    assert f"table 'replay' max_size is 3 in the config, but the checkpoint holds {ITEMS} items" in text, text
    # Set back as the checkpoint had it: it restores.
    daemon = DaemonProcess(tmp_path, _config(tmp_path, instance), "back")
    try:
        daemon.wait_ready()
        assert gear_client.Client(daemon.address).server_info(timeout=30)["replay"].current_size == ITEMS
    finally:
        daemon.stop()
