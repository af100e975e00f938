"""The daemon as a child process (``python -m gear_server --config FILE``), ready when it says so over sd_notify."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from tests.support.paths import ROOT

START_TIMEOUT_S = 60.0


class DaemonProcess:
    """``python -m gear_server --config FILE`` in a child process, readiness read from a notify socket.

    The daemon's port comes from its READY status line ("... on port N"), so
    configs use ``port = 0``. stderr goes to ``<name>.log`` in the test's folder.
    """

    def __init__(self, folder, config_text: str, name: str = "daemon", env: dict[str, str] | None = None,
                 args: tuple[str, ...] = ()):
        self.folder = folder
        self.config_path = folder / f"{name}.toml"
        self.config_path.write_text(config_text)
        self.log_path = folder / f"{name}.log"
        self.notify_path = folder / f"{name}.notify"
        if self.notify_path.exists():
            self.notify_path.unlink()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.messages: list[str] = []
        child_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path), **(env or {})}
        child_env["PYTHONPATH"] = str(ROOT) + os.pathsep + child_env.get("PYTHONPATH", "")
        child_env.pop("JOURNAL_STREAM", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen([sys.executable, "-m", "gear_server", "--config", str(self.config_path), *args],
                                        stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=child_env)
        self.port: int | None = None

    def wait_for(self, prefix: str, timeout: float = START_TIMEOUT_S) -> str:
        """The next notify datagram holding a line that starts with ``prefix`` (all are kept in ``messages``)."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages:
                if any(line.startswith(prefix) for line in message.split("\n")):
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.process.poll() is not None and not self._drain(0.2):
                raise AssertionError(f"no {prefix!r} from the daemon (exit code {self.process.poll()}); "
                                     f"log:\n{self.log}")
            self._drain(min(remaining, 0.5))

    def _drain(self, timeout: float) -> bool:
        self.notify.settimeout(timeout)
        try:
            self.messages.append(self.notify.recv(65536).decode())
            return True
        except TimeoutError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> int:
        message = self.wait_for("READY=1", timeout)
        self.port = int(re.search(r"on port (\d+)", message).group(1))
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=None, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig or signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        if self.notify.fileno() >= 0:
            while self._drain(0.05):  # keep what the daemon said on its way out
                pass
            self.notify.close()
            self._log.close()


def run_daemon(config_path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m gear_server --config FILE ARGS`` run to its end (a start that must fail); stderr as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("NOTIFY_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "gear_server", "--config", str(config_path), *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
