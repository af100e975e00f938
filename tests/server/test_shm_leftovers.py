"""A daemon's start removes what dead daemons left in its shm directory: segments and ingest sockets.

Real processes: one listens on an ingest socket and is killed (its socket file
stays); one listens and lives on; a socket named for a dead pid that a live
process (another pid namespace, say) still listens on is kept too.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.daemon_process import DaemonProcess

LISTEN = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(os.path.join(sys.argv[1], f"gear.other.{os.getpid()}.ingest.sock"))
s.listen()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def shm_dir():
    path = Path(f"/dev/shm/gear-leftovers-{uuid.uuid4().hex[:10]}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _listener(folder: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", LISTEN, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    return child.pid


def test_a_start_removes_the_ingest_sockets_of_dead_daemons(tmp_path, shm_dir):
    killed = _listener(shm_dir)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    stale = shm_dir / f"gear.other.{killed.pid}.ingest.sock"
    alive = _listener(shm_dir)
    elsewhere = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    elsewhere_path = shm_dir / f"gear.other.{_dead_pid()}.ingest.sock"
    elsewhere.bind(str(elsewhere_path))
    elsewhere.listen()
    daemon = None
    try:
        assert stale.is_socket()
        daemon = DaemonProcess(tmp_path, f'''
bind_address = "127.0.0.1"
port = 0
shm_dir = "{shm_dir}"
instance_name = "left{uuid.uuid4().hex[:6]}"

[[tables]]
name = "queue"
preset = "queue"
max_size = 10
''')
        daemon.wait_ready()
        assert not stale.exists()
        assert (shm_dir / f"gear.other.{alive.pid}.ingest.sock").is_socket()  # its process lives
        assert elsewhere_path.is_socket()  # someone listens on it
        assert f"removed 1 stale segment(s) and socket(s) of dead daemons: {stale}" in daemon.log, daemon.log
        assert daemon.stop() == 0
        daemon = None
        assert sorted(p.name for p in shm_dir.iterdir()) == sorted(
            [f"gear.other.{alive.pid}.ingest.sock", elsewhere_path.name])  # the daemon left nothing behind
    finally:
        if daemon is not None:
            daemon.stop()
        elsewhere.close()
        alive.stdin.close()
        alive.wait(30)
