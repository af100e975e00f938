"""docs/OPERATIONS.md's Python health check (for hosts without grpc_health_probe) runs as written."""

from __future__ import annotations

import subprocess
import sys
import uuid

from tests.support.daemon_process import DaemonProcess
from tests.support.paths import ROOT
from tests.support.tables_toml import tables_toml

VENV_PYTHON = "/opt/gear/venv/bin/python"


def _one_liner(port: int) -> str:
    """The documented command, for this test's interpreter and the daemon's port."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith(f"{VENV_PYTHON} -c ")]
    assert "localhost:8000" in line
    return line.replace(VENV_PYTHON, sys.executable, 1).replace("localhost:8000", f"localhost:{port}")


def test_the_python_health_check_says_serving_then_fails_once_the_daemon_is_gone(tmp_path):
    daemon = DaemonProcess(tmp_path, tables_toml(f"probe{uuid.uuid4().hex[:8]}"))
    try:
        port = daemon.wait_ready()
        command = _one_liner(port)
        serving = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert serving.returncode == 0, serving.stderr
        assert serving.stdout.strip() == "SERVING"
    finally:
        assert daemon.stop() == 0
    gone = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0 and "SERVING" not in gone.stdout
