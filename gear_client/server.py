"""Reverb's Server, Table and TableInfo.

``Server(tables, port)`` runs a gear daemon for the caller, by default as a
child process (``python -m gear_server --control-fd N``): the daemon does not
share the caller's GIL, gets its config as a serialized gear.v1.ServerConfig
over a socket (no pickle), reports the port it bound, and stops when
``stop()`` is called or the caller goes away (the socket closes); on stop it
unlinks its shared-memory segments. ``in_process=True`` runs the daemon on
threads of this process instead (tests, debugging).

A ``Table`` describes a table; once a Server hosts it, ``info``,
``can_sample`` and ``can_insert`` ask that Server's daemon.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from gear_client import checkpointers as checkpointers_lib
from gear_client.table_info import TableInfo, TableWorkerTime
from gear_contract import rate_limiters as rate_limiters_lib
from gear_contract import selectors as selectors_lib
from gear_contract import specs
from gear_contract._proto import replay_pb2 as pb

__all__ = ["Server", "Table", "TableInfo", "TableWorkerTime"]

log = logging.getLogger(__name__)

# How long a child daemon may take to start (imports, table creation) and to stop.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0


class Table:
    """A table's definition: selectors, size, rate limiter, signature (Reverb's ``reverb.Table``)."""

    def __init__(self, name: str, sampler: selectors_lib.SelectorType, remover: selectors_lib.SelectorType,
                 max_size: int, rate_limiter: rate_limiters_lib.RateLimiter, max_times_sampled: int = 0,
                 extensions: Sequence[Any] = (), signature: Any = None, gpu_mirror: dict[str, Any] | None = None):
        """Define a table; it is created, empty, when a Server is started with it.

        Args:
          name: the table's name, unique within its server.
          sampler: the selector that picks items to sample (``reverb.selectors``).
          remover: the selector that picks the item to remove when the table is full.
          max_size: the most items the table holds.
          rate_limiter: the rate limiter between inserts and samples (``reverb.rate_limiters``).
          max_times_sampled: remove an item after it was sampled that many times (0: never).
          extensions: Reverb's C++ table extensions: not supported, must be empty.
          signature: a nest of specs (anything with ``.shape`` and ``.dtype``, ``tf.TensorSpec`` too) the
            items must match; None: items of any structure.
          gpu_mirror: gear only: mirror the table's most recent items into one GPU's memory on the daemon's
            host, e.g. ``{"device": 0, "bytes": 8 << 30}`` (``bytes`` may be ``"8GiB"``; docs/DATA_PLANES.md,
            device tier).

        Raises:
          ValueError: an empty name, ``max_size`` not positive, extensions given, a sampler, remover or rate
            limiter that is not one of Reverb's, a signature that cannot be expressed, or a bad
            ``gpu_mirror`` option (the message names it).
        """
        if not name:
            raise ValueError("name must be nonempty")
        if max_size <= 0:
            raise ValueError(f"max_size ({max_size}) must be a positive integer")
        if extensions:
            raise ValueError("table extensions are not supported by gear")
        for role, selector in (("sampler", sampler), ("remover", remover)):
            if not hasattr(selector, "to_proto"):
                raise ValueError(f"{role} must be one of reverb.selectors, got {selector!r}")
        if not hasattr(rate_limiter, "to_proto"):
            raise ValueError(f"rate_limiter must be one of reverb.rate_limiters, got {rate_limiter!r}")
        signature_proto = None
        if signature:
            try:
                signature_proto = specs.signature_to_proto(signature)
            except (TypeError, ValueError) as e:
                raise ValueError(f"Unsupported signature spec: {e}") from e
        self._name = name
        self._sampler = sampler
        self._remover = remover
        self._max_size = int(max_size)
        self._rate_limiter = rate_limiter
        self._max_times_sampled = int(max_times_sampled)
        self._signature = signature
        self._signature_proto = signature_proto
        self._gpu_mirror_option = gpu_mirror
        self._gpu_mirror = gpu_mirror_proto(gpu_mirror, name) if gpu_mirror is not None else None
        self._server: Server | None = None

    @classmethod
    def queue(cls, name: str, max_size: int, extensions: Sequence[Any] = (), signature: Any = None) -> Table:
        """A table that behaves as a queue of ``max_size`` items (each sampled once, oldest first).

        Args:
          name: the table's name.
          max_size: the most items the queue holds; inserts block while it is full.
          extensions: not supported, must be empty.
          signature: as for ``Table``.

        Raises:
          ValueError: as for ``Table``.
        """
        return cls(name=name, sampler=selectors_lib.Fifo(), remover=selectors_lib.Fifo(), max_size=max_size,
                   max_times_sampled=1, rate_limiter=rate_limiters_lib.Queue(max_size), extensions=extensions,
                   signature=signature)

    @classmethod
    def stack(cls, name: str, max_size: int, extensions: Sequence[Any] = (), signature: Any = None) -> Table:
        """A table that behaves as a stack of ``max_size`` items (each sampled once, newest first).

        Args:
          name: the table's name.
          max_size: the most items the stack holds; inserts block while it is full.
          extensions: not supported, must be empty.
          signature: as for ``Table``.

        Raises:
          ValueError: as for ``Table``.
        """
        return cls(name=name, sampler=selectors_lib.Lifo(), remover=selectors_lib.Lifo(), max_size=max_size,
                   max_times_sampled=1, rate_limiter=rate_limiters_lib.Stack(max_size), extensions=extensions,
                   signature=signature)

    def replace(self, name: str | None = None, sampler: Any = None, remover: Any = None, max_size: int | None = None,
                rate_limiter: Any = None, max_times_sampled: int | None = None, signature: Any = None,
                extensions: Sequence[Any] | None = None, gpu_mirror: dict[str, Any] | None = None) -> Table:
        """A new, empty table with this one's settings except those given.

        Args:
          name, sampler, remover, max_size, rate_limiter, max_times_sampled, signature, extensions, gpu_mirror:
            as for ``Table``; None keeps this table's setting.

        Raises:
          ValueError: as for ``Table``.
        """
        return Table(
            name=self._name if name is None else name, sampler=sampler or self._sampler,
            remover=remover or self._remover, max_size=self._max_size if max_size is None else max_size,
            rate_limiter=rate_limiter or self._rate_limiter,
            max_times_sampled=self._max_times_sampled if max_times_sampled is None else max_times_sampled,
            extensions=extensions or (), signature=self._signature if signature is None else signature,
            gpu_mirror=self._gpu_mirror_option if gpu_mirror is None else gpu_mirror,
        )

    @property
    def name(self) -> str:
        return self._name

    def to_proto(self) -> pb.TableConfig:
        """The TableConfig the daemon builds this table from."""
        config = pb.TableConfig(name=self._name, sampler=self._sampler.to_proto(), remover=self._remover.to_proto(),
                                max_size=self._max_size, rate_limiter=self._rate_limiter.to_proto(),
                                max_times_sampled=self._max_times_sampled)
        if self._signature_proto is not None:
            config.signature.CopyFrom(self._signature_proto)
        if self._gpu_mirror is not None:
            config.gpu_mirror.CopyFrom(self._gpu_mirror)
        return config

    def _bound_client(self):
        server = self._server
        if server is None or server._stopped:
            return None
        return server._client()

    @property
    def info(self) -> TableInfo:
        """The table's TableInfo (from its Server's daemon once hosted)."""
        client = self._bound_client()
        if client is not None:
            return TableInfo.from_proto(client._table_info(self._name, refresh=True))
        limiter = self._rate_limiter
        return TableInfo(
            name=self._name, sampler_options=self._sampler.to_proto(), remover_options=self._remover.to_proto(),
            max_size=self._max_size, max_times_sampled=self._max_times_sampled,
            rate_limiter_info=pb.RateLimiterInfo(samples_per_insert=limiter.samples_per_insert,
                                                 min_diff=limiter.min_diff, max_diff=limiter.max_diff,
                                                 min_size_to_sample=limiter.min_size_to_sample),
            signature=None if self._signature_proto is None else specs.signature_from_proto(self._signature_proto),
            current_size=0, num_episodes=0, num_deleted_episodes=0, num_unique_samples=0,
            table_worker_time=TableWorkerTime(),
        )

    def can_sample(self, num_samples: int) -> bool:
        """True if a sample of ``num_samples`` items is permitted now (False before a Server hosts the table).

        Args:
          num_samples: the number of items a sample would take.

        Raises:
          ConnectError: the hosting daemon stayed unreachable past the connect timeout.
        """
        client = self._bound_client()
        if client is None:
            return False  # an empty table
        return client._check_rate_limiter(self._name, num_samples=int(num_samples)).can_sample

    def can_insert(self, num_inserts: int) -> bool:
        """True if ``num_inserts`` inserts are permitted now (by the rate limiter's settings before hosting).

        Args:
          num_inserts: the number of inserts.

        Raises:
          ConnectError: the hosting daemon stayed unreachable past the connect timeout.
        """
        client = self._bound_client()
        if client is not None:
            return client._check_rate_limiter(self._name, num_inserts=int(num_inserts)).can_insert
        limiter = self._rate_limiter
        if num_inserts <= limiter.min_size_to_sample:
            return True
        return num_inserts * limiter.samples_per_insert <= limiter.max_diff

    def __repr__(self) -> str:
        return (f"Table(name={self._name!r}, sampler={self._sampler!r}, remover={self._remover!r}, "
                f"max_size={self._max_size}, max_times_sampled={self._max_times_sampled}, "
                f"rate_limiter={self._rate_limiter!r}, signature={self._signature!r})")


class Server:
    """A gear replay daemon serving ``tables`` (Reverb's ``reverb.Server``)."""

    def __init__(self, tables: Sequence[Table] | None = None, port: int | None = None,
                 checkpointer: checkpointers_lib.CheckpointerBase | None = None, *, in_process: bool = False,
                 log_level: str | None = None):
        """Start a daemon serving ``tables``; returns once it takes calls.

        Args:
          tables: the tables to serve (at least one; names unique).
          port: the port to serve on (None or 0: a free port, see ``port``).
          checkpointer: where checkpoints go and which one is restored at start (default: a temporary
            directory removed at ``stop``).
          in_process: run the daemon in this process instead of a child process.
          log_level: the daemon's log level (default ``GEAR_SERVER_LOG_LEVEL``, else WARNING).

        Raises:
          ValueError: no table, two tables of one name, or a port out of range.
          RuntimeError: the daemon failed to start (the message says why).
        """
        if not tables:
            raise ValueError("At least one table must be provided")
        names = collections.Counter(table.name for table in tables)
        duplicates = [name for name, count in names.items() if count > 1]
        if duplicates:
            raise ValueError(f"Multiple items in tables have the same name: {', '.join(duplicates)}")
        if port is not None and not 0 <= int(port) <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        self._owned_checkpoint_dir: str | None = None
        if checkpointer is None:
            checkpointer = checkpointers_lib.default_checkpointer()
            self._owned_checkpoint_dir = checkpointer.path
        config = pb.ServerConfig(bind_address="[::]", port=int(port or 0), tables=[t.to_proto() for t in tables])
        checkpointer.configure(config)
        self._config = config
        self._tables = list(tables)
        self._stopped = False
        self._lock = threading.Lock()
        self._client_instance = None
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._daemon = None
        try:
            if in_process:
                self._port = self._start_in_process(config)
            else:
                self._port = self._start_child(config, log_level or os.environ.get("GEAR_SERVER_LOG_LEVEL", "WARNING"))
        except BaseException:
            self._stopped = True
            self._remove_owned_checkpoint_dir()
            raise
        for table in self._tables:
            table._server = self
        self._finalizer = weakref.finalize(self, _stop_quietly, self._process, self._control, self._daemon,
                                           self._owned_checkpoint_dir)

    # ------------------------------------------------------------------ start
    def _start_in_process(self, config: pb.ServerConfig) -> int:
        from gear_server.cli import reverb_server_auth
        from gear_server.config import DaemonSettings
        from gear_server.daemon import Daemon

        settings = DaemonSettings.from_server_config(config)
        settings.auth = reverb_server_auth()  # Reverb's Server: no credentials, every interface
        self._daemon = Daemon(settings)
        return self._daemon.start()

    def _start_child(self, config: pb.ServerConfig, log_level: str) -> int:
        from gear_server.cli import send_config_message

        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # systemd readiness belongs to the parent's unit, not to this child
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where gear_client/gear_server live
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        command = [sys.executable, "-m", "gear_server", "--control-fd", str(child.fileno()), "--log-level", log_level]
        try:
            self._process = subprocess.Popen(command, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=env,
                                             start_new_session=False)
        finally:
            child.close()
        self._control = parent
        send_config_message(parent, config)
        line = _read_line(parent, START_TIMEOUT_S, self._process)
        if line.startswith("port "):
            return int(line.split()[1])
        self._terminate_child()
        if line.startswith("error "):
            raise RuntimeError(f"the gear daemon failed to start: {line[len('error '):]}")
        raise RuntimeError(f"the gear daemon failed to start ({line or 'no answer'}; "
                           f"exit code {self._process.poll()})")

    # ------------------------------------------------------------------ API
    @property
    def port(self) -> int:
        """The port the daemon serves on."""
        return self._port

    @property
    def pid(self) -> int:
        """The daemon's process id (this process for an in-process daemon)."""
        return self._process.pid if self._process is not None else os.getpid()

    def localhost_client(self):
        """A Client connected to this server over localhost."""
        from gear_client.client import Client

        return Client(f"localhost:{self._port}")

    def _client(self):
        with self._lock:
            if self._client_instance is None:
                self._client_instance = self.localhost_client()
            return self._client_instance

    def stop(self) -> None:
        """Stop the daemon and free everything it holds (port, shared memory). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            client, self._client_instance = self._client_instance, None
        if client is not None:
            client.close()
        if self._daemon is not None:
            self._daemon.stop()
        if self._process is not None:
            self._terminate_child()
        self._finalizer.detach()
        self._remove_owned_checkpoint_dir()

    def wait(self) -> None:
        """Block until the daemon stops (stop() from another thread, or the daemon exits).

        KeyboardInterrupt (SIGINT) stops the daemon and propagates, as in Reverb.
        """
        try:
            if self._process is not None:
                while self._process.poll() is None:
                    time.sleep(0.2)
            elif self._daemon is not None:
                while not self._daemon.wait(0.2):
                    pass
        except KeyboardInterrupt:
            self.stop()
            raise

    def _terminate_child(self) -> None:
        process = self._process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("gear daemon pid %d did not stop in %.0f s; killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.wait()
        if self._control is not None:
            self._control.close()
            self._control = None

    def _remove_owned_checkpoint_dir(self) -> None:
        """Remove the temporary checkpoint directory made for this server if nothing was written there."""
        _remove_if_empty(self._owned_checkpoint_dir)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server(port={self._port}, tables={[t.name for t in self._tables]}, pid={self.pid})"


def gpu_mirror_proto(option: dict[str, Any], table: str) -> pb.GpuMirror:
    """A table's ``gpu_mirror`` option, validated as the daemon's TOML is (ValueError naming the problem)."""
    from gear_server.config import gpu_mirror_from_toml

    return gpu_mirror_from_toml(option, f"table {table!r} gpu_mirror")


def _remove_if_empty(path: str | None) -> None:
    if path and os.path.isdir(path) and not os.listdir(path):
        shutil.rmtree(path, ignore_errors=True)


def _read_line(sock: socket.socket, timeout: float, process: subprocess.Popen) -> str:
    """One line from the control socket, waiting at most ``timeout`` s ('' if the child died first)."""
    data = bytearray()
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timed out waiting for the daemon"
        ready, _, _ = select.select([sock], [], [], min(remaining, 0.5))
        if not ready:
            if process.poll() is not None:
                return ""
            continue
        part = sock.recv(4096)
        if not part:
            return data.decode(errors="replace").strip()
        data += part
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


def _stop_quietly(process: subprocess.Popen | None, control: socket.socket | None, daemon: Any,
                  checkpoint_dir: str | None) -> None:
    """Finalizer of a Server dropped without stop(): end its daemon, remove its unused temporary directory."""
    try:
        if daemon is not None:
            daemon.stop()
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(STOP_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a finalizer's best effort
        pass
    finally:
        if control is not None:
            control.close()
        _remove_if_empty(checkpoint_dir)

