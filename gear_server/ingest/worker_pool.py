"""The daemon's ingest worker processes: start them, learn their ports, stop them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time

from gear_server.ingest.worker_process import ENV_AUTH, ENV_LIMITS
from gear_server.ops.auth import AuthSettings
from gear_server.rpc.limits import LimitSettings

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


class WorkerPool:
    """``count`` ingest workers (gear_server.ingest.worker_process) serving InsertStream on their own ports.

    Each enforces the daemon's ``[auth]`` and ``[limits]`` (``limits``: the daemon's; each worker counts its
    own open streams and buffered bytes); ``threads``: pool jobs of one table at once (None: the worker's default).
    """

    def __init__(self, count: int, daemon_address: str, bind: str, auth: AuthSettings | None, *,
                 limits: LimitSettings | None = None, threads: int | None = None):
        self.count = int(count)
        self.daemon_address = daemon_address
        self.bind = bind
        self.auth = auth or AuthSettings()
        self.limits = limits or LimitSettings()
        self.threads = threads
        self.processes: list[subprocess.Popen] = []
        self.ports: list[int] = []

    def start(self) -> list[int]:
        """Start every worker and wait until each serves; returns their ports (OSError if one fails)."""
        env = dict(os.environ)
        env[ENV_AUTH] = json.dumps(dataclasses.asdict(self.auth))
        env[ENV_LIMITS] = json.dumps(dataclasses.asdict(self.limits))
        command = [sys.executable, "-m", "gear_server.ingest.worker_process", "--daemon", self.daemon_address,
                   "--bind", self.bind]
        if self.threads is not None:
            command += ["--threads", str(self.threads)]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True))
            for process in self.processes:
                self.ports.append(self._await_port(process))
        except BaseException:
            self.stop()
            raise
        log.info("%d ingest worker(s) serving InsertStream on port(s) %s", self.count,
                 ", ".join(map(str, self.ports)))
        return self.ports

    @staticmethod
    def _await_port(process: subprocess.Popen) -> int:
        found: list[int] = []

        def read() -> None:
            for line in process.stdout:
                if line.startswith("PORT "):
                    found.append(int(line.split()[1]))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not found:
            raise OSError(f"ingest worker pid {process.pid} did not start within {START_TIMEOUT_S} s "
                          f"(exit code {process.poll()})")
        return found[0]

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the workers (SIGTERM, then SIGKILL after ``timeout``)."""
        processes, self.processes = self.processes, []
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self.ports = []
