"""Starts of real daemon processes that must be refused, and refused without harm.

A start that fails (its metrics port taken) writes and removes no checkpoint; a
checkpoint directory in use by a live daemon is refused to another; several
daemons on one host run from one file with the flags docs/SHARDING.md gives.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import gear_client
from gear_server.checkpoint.checkpointer import COMPLETE
from tests.support.daemon_process import DaemonProcess, run_daemon
from tests.support.paths import ROOT
from tests.support.tables_toml import tables_toml

VENV_BIN = Path(sys.executable).parent


def _config(tmp_path, keep: int = 1, metrics_port: int | None = None) -> str:
    text = tables_toml(f"starts{uuid.uuid4().hex[:8]}") + f'''
[checkpoint]
dir = "{tmp_path / 'checkpoints'}"
keep = {keep}
on_stop = true
'''
    if metrics_port is not None:
        text += f"\n[metrics]\nbind = \"127.0.0.1\"\nport = {metrics_port}\n"
    return text


def _run_daemon(tmp_path, config: str, name: str, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"{name}.toml"
    path.write_text(config)
    return run_daemon(path, *args)


def _listing(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its size (what a start must not change)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _first_checkpoint(tmp_path) -> Path:
    """One daemon run that stops with SIGTERM: one complete checkpoint holding three items."""
    daemon = DaemonProcess(tmp_path, _config(tmp_path), "first")
    try:
        daemon.wait_ready()
        client = gear_client.Client(daemon.address)
        for v in range(3):
            client.insert({"obs": np.full(4, v, np.float32)}, priorities={"queue": 1.0})
        assert daemon.stop(signal.SIGTERM) == 0
    finally:
        daemon.close()
    (checkpoint,) = [p for p in (tmp_path / "checkpoints").iterdir() if (p / COMPLETE).exists()]
    return checkpoint


def test_a_start_that_fails_writes_and_removes_no_checkpoint(tmp_path):
    checkpoint = _first_checkpoint(tmp_path)
    before = _listing(tmp_path / "checkpoints")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run_daemon(tmp_path, _config(tmp_path, keep=1, metrics_port=port), "second")
    assert result.returncode == 1, result.stderr
    assert "cannot start" in result.stderr and "metrics endpoint cannot listen" in result.stderr, result.stderr
    assert "checkpoint written" not in result.stderr, result.stderr
    assert "checkpoint removed" not in result.stderr, result.stderr
    assert "serving 2 table(s)" not in result.stderr, result.stderr
    assert _listing(tmp_path / "checkpoints") == before
    assert (checkpoint / COMPLETE).exists()


def test_a_checkpoint_dir_in_use_is_refused_to_a_second_daemon(tmp_path):
    config = _config(tmp_path, keep=1)
    first = DaemonProcess(tmp_path, config, "first")
    try:
        first.wait_ready()
        client = gear_client.Client(first.address)
        client.insert({"obs": np.zeros(4, np.float32)}, priorities={"queue": 1.0})
        client.checkpoint()
        before = _listing(tmp_path / "checkpoints")
        result = _run_daemon(tmp_path, config, "second")
        assert result.returncode == 1, result.stderr
        assert re.search(rf"checkpoint dir .*checkpoints is in use by another running daemon \(pid "
                         rf"{first.process.pid}\)", result.stderr), result.stderr
        assert "checkpoint written" not in result.stderr and "checkpoint removed" not in result.stderr
        assert _listing(tmp_path / "checkpoints") == before
        assert client.server_info(timeout=30)["queue"].current_size == 1  # the first one serves on
        # A directory of its own lets the second daemon start.
        second = DaemonProcess(tmp_path, config.replace(f'dir = "{tmp_path / "checkpoints"}"',
                                                        f'dir = "{tmp_path / "other"}"'), "second-own")
        try:
            second.wait_ready()
        finally:
            assert second.stop() == 0
    finally:
        assert first.stop() == 0
    # Stopped: the directory is free again, and its checkpoint restores.
    third = DaemonProcess(tmp_path, config, "third")
    try:
        third.wait_ready()
        assert gear_client.Client(third.address).server_info(timeout=30)["queue"].current_size == 1
    finally:
        third.stop()


def test_the_flags_override_the_metrics_port_and_checkpoint_dir(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run_daemon(tmp_path, _config(tmp_path, keep=1), "flags", "--metrics-port", str(port),
                             "--checkpoint-dir", str(tmp_path / "flagged"))
    assert result.returncode == 1 and f"metrics endpoint cannot listen on 127.0.0.1:{port}" in result.stderr, \
        result.stderr
    assert (tmp_path / "flagged").is_dir()  # the flag's directory was taken, not the file's
    assert not (tmp_path / "checkpoints").exists()


def _one_host_block() -> str:
    text = (ROOT / "docs" / "SHARDING.md").read_text()
    section = text[text.index("## Several shards on one host"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _wait_port(port: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on port {port} after {timeout:g} s") from None
            time.sleep(0.2)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (the recipe's shell is gone: init reaps them)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_the_one_host_sharding_recipe_runs_as_written(tmp_path):
    ports = (8001, 8002, 8003)
    for port in (*ports, 9581, 9582, 9583):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} is taken on this machine: the recipe's ports are fixed")
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run(["bash", "-euo", "pipefail", "-c", _one_host_block()], cwd=tmp_path, env=env, check=True,
                   timeout=60)
    pids = [int((tmp_path / "shards" / f"{i}.pid").read_text()) for i in (1, 2, 3)]
    try:
        for port in (*ports, 9581, 9582, 9583):
            _wait_port(port)
        token = (tmp_path / "shards" / "token").read_text()
        client = gear_client.Client("localhost:8001,localhost:8002,localhost:8003", token=token)
        assert client.server_info(timeout=30)["replay"].max_size == 3 * 1_000_000
    finally:
        subprocess.run(["bash", "-c", "kill $(cat shards/*.pid)"], cwd=tmp_path, timeout=30)
        for pid in pids:
            deadline = time.monotonic() + 60
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _running(pid)
    logs = [(tmp_path / "shards" / f"{i}.log").read_text() for i in (1, 2, 3)]
    for i, log in enumerate(logs, 1):
        assert "cannot start" not in log, log
        assert f"checkpoint written path={tmp_path / 'shards' / str(i) / 'checkpoints'}" in log, log
