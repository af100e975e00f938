"""The daemon's one hook for ingest: the insert plane RPC, its local socket and the worker processes."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from grpc import aio

from gear_server.ingest.plane_service import InsertPlaneManager
from gear_server.ingest.settings import IngestSettings
from gear_server.ingest.worker_pool import WorkerPool
from gear_server.ops.auth import AuthSettings
from gear_server.rpc.limits import LimitSettings
from gear_server.rpc.table_calls import TableCalls

log = logging.getLogger(__name__)


def socket_path(store: Any) -> str:
    """The daemon's local socket for its ingest workers, beside its segments (cleaned like them when stale)."""
    path = os.path.join(store.shm_dir, f"gear.{store.instance}.{store.pid}.ingest.sock")
    if len(path) > 100:  # unix socket paths are limited to 108 bytes
        path = os.path.join(tempfile.gettempdir(), f"gear.{store.instance}.{store.pid}.ingest.sock")
    return path


class Ingest:
    """Insert plane (always, unless ``[ingest] insert_plane = false``) and ingest workers (``[ingest] workers``).

    Steps, called by the daemon: ``add_to_server(server)`` while it builds the
    server (registers InsertPlane and, with workers, binds the local socket they
    commit through), ``start(bind_address)`` once it serves (starts the
    workers), ``ports()`` for ServerInfo, ``stop()``.
    """

    def __init__(self, settings: IngestSettings | None, tables: Mapping[str, Any], host_id: str, calls: TableCalls, *,
                 socket_path: str, auth: AuthSettings | None = None, metrics: Any = None,
                 limits: LimitSettings | None = None, stream: Any = None):
        """``stream``: the daemon's stream-plane server, through which writers on other hosts send their rows."""
        self.settings = settings or IngestSettings()
        self.settings.check()
        self.auth = auth
        self.limits = limits  # the daemon's [limits]: each worker enforces them on its own streams
        self.socket_path = socket_path
        self.plane: InsertPlaneManager | None = None
        if self.settings.insert_plane:
            self.plane = InsertPlaneManager(tables, host_id, calls,
                                            reservation_timeout_s=self.settings.reservation_timeout_s,
                                            max_reservations=self.settings.max_reservations_per_stream)
            self.plane.metrics = metrics
            self.plane.stream = stream
        self.pool: WorkerPool | None = None
        self._turn = -1

    def add_to_server(self, server: aio.Server) -> None:
        if self.plane is None:
            return
        self.plane.add_to_server(server)
        if self.settings.workers:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            if not server.add_insecure_port(f"unix:{self.socket_path}"):
                raise OSError(f"cannot bind the ingest workers' socket {self.socket_path}")

    def start(self, bind_address: str) -> list[int]:
        if not self.settings.workers:
            return []
        os.chmod(self.socket_path, 0o600)
        self.pool = WorkerPool(self.settings.workers, f"unix:{self.socket_path}",
                               self.settings.bind_address or bind_address, self.auth,
                               limits=self.limits)
        return self.pool.start()

    def ports(self) -> list[int]:
        return list(self.pool.ports) if self.pool is not None else []

    def advertised_ports(self) -> list[int]:
        """The workers' ports for ServerInfo, starting one further each call: writers take the first, so
        writers opened one after another spread evenly over the workers."""
        ports = self.ports()
        if not ports:
            return ports
        self._turn = (self._turn + 1) % len(ports)
        return ports[self._turn:] + ports[:self._turn]

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.stop()
        if self.plane is not None:
            self.plane.shutdown()
        if self.settings.workers:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
