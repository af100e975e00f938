"""The two actor classes behind gear_ray: the registry (discovery) and the daemon of one node.

``Registry`` is a named actor: it holds the configuration document, the nodes chosen, and what each
node's daemon last registered (address, port, process id). Clients ask it for the shard list; a
restarted daemon actor asks it for the port its node had, so the shard comes back at the address the
clients know. Ray restarts a registry that dies; the daemon actors register again within seconds.

``ShardDaemon`` runs ``gear-server`` as a child process on its node (``python -m gear_server --config
FILE --control-fd N``: the child reports the port it bound, and stops when the socket closes, so it never
outlives the actor; Ray also ends a dead worker's children). When the child exits without being asked
to, the actor exits too and Ray restarts it (``max_restarts``); the new actor waits for the old child to
be gone, starts a daemon that restores the node's last complete checkpoint, and registers again.
``stop()`` drains: SIGTERM to the child, whose graceful stop writes the final checkpoint.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gear_ray.config import ENV_SHM_DIR, node_document, render_toml

log = logging.getLogger(__name__)

ENV_HOST_ID = "GEAR_HOST_ID"  # gear's host identity override (gear_contract.negotiation), also the node's key
START_TIMEOUT_S = 900.0  # a daemon restoring a large checkpoint takes a while
STOP_TIMEOUT_S = 900.0  # and so does its final checkpoint
REREGISTER_S = 2.0  # how often a daemon actor checks that the registry still lists it


class Registry:
    """Discovery of one gear deployment (see module docstring). All state is plain data."""

    def __init__(self, name: str, document: dict[str, Any], node_ids: list[str]):
        self.name = name
        self.document = document
        self.node_ids = list(node_ids)
        self.entries: dict[str, dict[str, Any]] = {}
        self.stopping = False

    def config(self) -> dict[str, Any]:
        return self.document

    def previous(self, node_id: str) -> dict[str, Any] | None:
        """What this node's daemon last registered (None: never started)."""
        return self.entries.get(node_id)

    def register(self, node_id: str, entry: dict[str, Any]) -> None:
        entry = dict(entry, starts=self.entries.get(node_id, {}).get("starts", 0) + 1, registered_at=time.time())
        self.entries[node_id] = entry

    def shards(self) -> list[dict[str, Any]]:
        """The registered daemons in node order (every client numbers the shards alike)."""
        return [self.entries[n] for n in self.node_ids if n in self.entries]

    def expected(self) -> list[str]:
        return list(self.node_ids)


class ShardDaemon:
    """One node's gear daemon (see module docstring)."""

    def __init__(self, name: str, registry_name: str, namespace: str | None, port: int, checkpoint_root: str,
                 log_level: str = "INFO"):
        import ray

        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.registry = ray.get_actor(registry_name, namespace=namespace)
        document, previous = ray.get([self.registry.config.remote(), self.registry.previous.remote(self.node_id)])
        node_key = os.environ.get(ENV_HOST_ID) or socket.gethostname()
        self.state_dir = Path(checkpoint_root).expanduser() / name / node_key
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._stopping = threading.Event()
        if previous is not None:
            _wait_gone(previous.get("pid"), STOP_TIMEOUT_S)  # the last daemon's final checkpoint first
            port = previous["port"]
        shm_dir = os.environ.get(ENV_SHM_DIR)
        if shm_dir:
            Path(shm_dir).mkdir(parents=True, exist_ok=True)
        config = node_document(document, port=port, checkpoint_dir=str(self.state_dir / "checkpoints"),
                               shm_dir=shm_dir)
        self.config_path = self.state_dir / "gear-server.toml"
        self.config_path.write_text(render_toml(config))
        self.process, self.control, self.port = _spawn(self.config_path, self.state_dir, log_level)
        ip = _advertised_host(config.get("bind_address", "[::]"), ray.util.get_node_ip_address())
        self.address = f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"
        self.entry = {"node_id": self.node_id, "address": self.address, "port": self.port, "pid": self.process.pid,
                      "actor_pid": os.getpid(),
                      "state_dir": str(self.state_dir), "host_key": node_key,
                      "restarted": bool(context.was_current_actor_reconstructed)}
        ray.get(self.registry.register.remote(self.node_id, self.entry))
        threading.Thread(target=self._watch, name="gear-ray-watch", daemon=True).start()
        log.info("gear daemon of node %s serving at %s (pid %d, checkpoints in %s)", self.node_id[:12],
                 self.address, self.process.pid, self.state_dir)

    def info(self) -> dict[str, Any]:
        """Where this node's daemon serves, its pid, its folder, whether Ray restarted this actor."""
        return dict(self.entry, alive=self.process.poll() is None)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Drain: SIGTERM to the daemon (its graceful stop writes the final checkpoint), wait for it to exit.

        Returns its exit code (None if it had to be killed after ``timeout_s``).
        """
        self._stopping.set()
        process = self.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("gear daemon pid %d did not stop within %.0f s: killed", process.pid, timeout_s)
                process.kill()
                process.wait()
                return None
        self.control.close()
        return process.returncode

    def _watch(self) -> None:
        """A daemon that exits unasked takes the actor down, so Ray restarts both. Meanwhile, every few seconds,
        the registry is told about this daemon again if it lost track of it (a registry actor Ray restarted)."""
        import ray

        while True:
            try:
                code = self.process.wait(REREGISTER_S)
                break
            except subprocess.TimeoutExpired:
                pass
            try:
                known = ray.get(self.registry.previous.remote(self.node_id), timeout=REREGISTER_S)
                if not known or known.get("pid") != self.entry["pid"]:
                    ray.get(self.registry.register.remote(self.node_id, self.entry), timeout=REREGISTER_S)
                    log.info("registered again with the registry of %s", self.address)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("the registry does not answer (%s); trying again in %.0f s", exc, REREGISTER_S)
        if self._stopping.is_set():
            return
        log.error("gear daemon pid %d exited (code %s): this actor exits for Ray to restart it", self.process.pid,
                  code)
        os._exit(1)


def _advertised_host(bind_address: str, node_ip: str) -> str:
    """The host clients dial: the node's Ray address for a daemon on every interface, else the one it binds."""
    host = bind_address.strip("[]")
    return node_ip if host in ("", "::", "0.0.0.0") else host


def _spawn(config_path: Path, cwd: Path, log_level: str) -> tuple[subprocess.Popen, socket.socket, int]:
    """Start ``python -m gear_server`` on ``config_path``; (process, control socket, port) once it serves."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    command = [sys.executable, "-m", "gear_server", "--config", str(config_path), "--control-fd", str(child.fileno()),
               "--log-level", log_level]
    try:
        process = subprocess.Popen(command, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, cwd=cwd, env=env)
    finally:
        child.close()
    line = _read_line(parent, process, START_TIMEOUT_S)
    if line.startswith("port "):
        return process, parent, int(line.split()[1])
    if process.poll() is None:
        process.kill()
        process.wait()
    parent.close()
    raise RuntimeError(f"the gear daemon did not start: {line or f'exit code {process.returncode}'}")


def _read_line(sock: socket.socket, process: subprocess.Popen, timeout: float) -> str:
    """The child's first line on the control socket ('' if it exited first)."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return f"no answer within {timeout:.0f} s"
        ready, _, _ = select.select([sock], [], [], min(remaining, 0.5))
        if not ready:
            if process.poll() is not None:
                return ""
            continue
        part = sock.recv(4096)
        if not part:
            break
        data += part
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


def _wait_gone(pid: int | None, timeout: float) -> None:
    """Wait until the gear daemon ``pid`` has exited (a pid now used by another program counts as gone)."""
    if not pid:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return
        if b"gear_server" not in cmdline:
            return
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":  # exited, not yet reaped by its new parent
            return
        time.sleep(0.2)
    log.warning("the previous gear daemon (pid %d) still runs after %.0f s: killing it", pid, timeout)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
