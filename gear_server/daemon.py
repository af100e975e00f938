"""The daemon: tables in shared memory plus the gRPC control plane, and their lifecycle.

``Daemon(settings)`` goes through clear steps so each operations concern hooks
into one place: ``build_tables()`` (clean stale segments, create tables),
``build_service()``, ``build_server()`` (gRPC server, options, interceptors,
extra services), ``bind()`` (address and credentials), ``start()`` and
``stop()``. ``serve()`` runs it in the foreground until ``request_stop()``
(SIGTERM/SIGINT with ``install_signal_handlers``).

The gRPC server is grpc.aio on an event loop thread of its own (``LoopThread``):
every call is a task there, so idle streams and calls waiting on a rate limiter
cost memory, not threads; table work runs on ``TableCalls``' bounded pool
(``max_workers`` threads).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import Any

from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_contract.allocator import tune_allocator
from gear_server import __version__
from gear_server.config import DaemonSettings
from gear_server.daemon_ops import Operations
from gear_server.data_planes.manager import DataPlaneManager
from gear_server.data_planes.nixl_server import NixlServer
from gear_server.data_planes.rdma_server import RdmaServer
from gear_server.data_planes.settings import DataPlaneSettings
from gear_server.data_planes.stream_server import open_stream_server
from gear_server.ops import sd_notify
from gear_server.rpc.event_loop import LoopThread
from gear_server.rpc.limits import LimitSettings
from gear_server.rpc.ports import GRPC_OPTIONS, bind
from gear_server.rpc.table_calls import TableCalls
from gear_server.serving.service import ReplayService
from gear_server.storage import SegmentStore

log = logging.getLogger(__name__)


def host_id() -> str:
    """This host's identity: learners offer theirs and the daemon compares them to pick the shm plane.

    The same function on both sides (boot id, host name, network namespace; see
    gear_contract.negotiation.local_host_id).
    """
    from gear_contract.negotiation import local_host_id

    return local_host_id()


class Daemon:
    """One replay daemon (see the module docstring for its steps)."""

    def __init__(self, settings: DaemonSettings | pb.ServerConfig, *, seed: int | None = None):
        if isinstance(settings, pb.ServerConfig):
            settings = DaemonSettings.from_server_config(settings)
        self.settings = settings
        self.config: pb.ServerConfig = settings.server
        self.seed = seed
        self.store: SegmentStore | None = None
        self.tables: dict[str, Any] = {}
        self.service: ReplayService | None = None
        self.ingest: Any = None  # gear_server.ingest.daemon_hook.Ingest: insert plane and ingest workers
        self.server: aio.Server | None = None
        self.port: int | None = None
        self.limits: LimitSettings = settings.limits or LimitSettings()
        self.calls: TableCalls | None = None
        self.loop: LoopThread | None = None
        self._keep_alive: asyncio.Task | None = None
        self.host_id = host_id()
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()
        self._state_lock = threading.Lock()
        self._started = False
        # Checkpoints, health, metrics, auth/TLS, sd_notify (gear_server/daemon_ops.py).
        self.ops = Operations(settings)

    # ------------------------------------------------------------------ steps
    def build_tables(self) -> dict[str, Any]:
        """Remove stale segments of dead daemons (any instance), then create every table."""
        from gear_server.table.table import Table

        self.store = SegmentStore(self.config.shm_dir or "/dev/shm", self.config.instance_name or "gear")
        removed = self.store.cleanup_stale()
        if removed:
            log.info("removed %d stale segment(s) and socket(s) of dead daemons: %s", len(removed), ", ".join(removed))
        tables = {}
        try:
            for i, table_config in enumerate(self.config.tables):
                seed = None if self.seed is None else self.seed + i
                tables[table_config.name] = Table(table_config, self.store, seed=seed)
        except BaseException:  # e.g. a GPU mirror refused: the tables built so far free their mirrors too
            for table in tables.values():
                table.close()
            raise
        return self.ops.restore(tables, lambda config: Table(config, self.store, seed=self.seed))

    def build_service(self) -> ReplayService:
        planes = self.build_data_planes()
        self.ops.attach_data_planes(planes)
        return ReplayService(self.tables, self.calls, host_id=self.host_id, version=__version__,
                             checkpoint=self.checkpoint_function(), data_planes=planes, metrics=self.ops.metrics,
                             limits=self.limits)

    def checkpoint_function(self):
        """The callable behind the Checkpoint RPC (None: UNIMPLEMENTED)."""
        return self.ops.checkpoint_function()

    def build_data_planes(self) -> DataPlaneManager:
        """The learner data-plane manager (RDMA with a device and pyverbs, nixl with gear[nixl], streams as
        configured)."""
        settings = self.settings.data_planes or DataPlaneSettings()
        rdma, rdma_off = RdmaServer.open(settings)
        stream, stream_off = open_stream_server(settings, self.config.bind_address or "[::]", self.settings.auth)
        nixl, nixl_off = NixlServer.open(settings)
        manager = DataPlaneManager(self.tables, self.host_id, self.calls, rdma=rdma, rdma_off=rdma_off,
                                   settings=settings, stream=stream, stream_off=stream_off, nixl=nixl,
                                   nixl_off=nixl_off)
        log.info("%s", manager.report.line())
        return manager

    def build_ingest(self) -> Any:
        """The insert plane and the ingest workers ([ingest] section)."""
        from gear_server.ingest.daemon_hook import Ingest, socket_path

        planes = self.service.data_planes if self.service is not None else None
        return Ingest(self.settings.ingest, self.tables, self.host_id, self.calls, socket_path=socket_path(self.store),
                      auth=self.settings.auth, metrics=self.ops.metrics, limits=self.limits,
                      stream=planes.stream if planes is not None else None)

    def server_options(self) -> list[tuple[str, Any]]:
        return list(GRPC_OPTIONS)

    def interceptors(self) -> list[aio.ServerInterceptor]:
        return self.ops.interceptors(self.limits)

    def build_server(self) -> aio.Server:
        """The grpc.aio server with the replay service (and any extra services) registered; on the loop."""
        server = aio.server(options=self.server_options(), interceptors=self.interceptors())
        self.service.add_to_server(server)
        self.ingest.add_to_server(server)
        self.ops.add_services(server)
        return server

    async def _serve(self) -> int:
        """Build, bind and start the server (on the loop); returns the bound port."""
        self.server = self.build_server()
        port = self.bind(self.server)
        await self.server.start()
        # WatchdogSec= in the unit: the keep-alives come from this loop, so a wedged loop gets the service restarted.
        self._keep_alive = asyncio.get_running_loop().create_task(sd_notify.keep_alive_forever())
        return port

    def bind(self, server: aio.Server) -> int:
        """Bind the configured address; returns the port (the one picked when port is 0)."""
        host = self.config.bind_address or "[::]"
        credentials = self.ops.server_credentials()
        port = bind(server, host, self.config.port, credentials)
        if not port:
            raise OSError(f"cannot bind {host}:{self.config.port} (in use or not an address of this host)")
        return port

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        """Build everything and start serving; returns the bound port."""
        with self._state_lock:
            if self._started:
                raise RuntimeError("the daemon was already started")
            self._started = True
        tune_allocator(mmap_threshold=64 << 20, trim_threshold=512 << 20, opt_in=False)
        try:
            self.ops.auth.check_exposure(self.config.bind_address or "[::]")  # before anything is built
            self.tables = self.build_tables()
            self.calls = TableCalls(self.settings.max_workers)
            self.service = self.build_service()
            self.ingest = self.build_ingest()
            self.loop = LoopThread("gear-serve")
            self.port = self.loop.run(self._serve())
            self.ingest.start(self.config.bind_address or "[::]")
            self.service.ingest_ports = self.ingest.advertised_ports
            self.ops.started(self)  # metrics endpoint, periodic checkpoints, READY=1
        except BaseException:
            # A start that fails serves nothing and touches no checkpoint: none is written or removed
            # (stop() after this returns at once).
            self._stopped.set()
            self.ops.start_failed()
            self._shutdown_data_planes()  # its lease reaper thread is running
            if self.ingest is not None:
                self.ingest.stop()
            self._stop_server(0)
            self._close_tables()
            self._release()
            raise
        log.info("serving %d table(s) [%s] on %s:%d (pid %d, segments in %s)", len(self.tables),
                 ", ".join(self.tables), self.config.bind_address or "[::]", self.port, os.getpid(),
                 self.config.shm_dir or "/dev/shm")
        return self.port

    def request_stop(self) -> None:
        """Ask ``serve()`` to stop (safe from signal handlers and other threads)."""
        self._stop_requested.set()

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving, wake blocked calls, close the tables and unlink every segment. Idempotent."""
        with self._state_lock:
            if self._stopped.is_set() or not self._started:
                self._stopped.set()
                return
            self._stopped.set()
        self._stop_requested.set()
        log.info("stopping")
        started = time.monotonic()
        self.ops.stopping()
        self._stop_sampling()  # waiting samples and Selects end (UNAVAILABLE) having taken nothing
        # Calls that took items hand them over before any call is cancelled (a loaded host may need seconds).
        if self.service is not None and not self.service.sampling.wait_idle(grace + 10.0):
            log.warning("%d sampling call(s) still delivering after %.0f s: stopping anyway (what they took "
                        "may not reach their callers)", len(self.service.sampling), grace + 10.0)
        done = None
        if self.server is not None and self.loop is not None and self.loop.alive:
            done = self.loop.submit(self.server.stop(grace))
        if done is not None and self.ops.checkpointer is not None:
            _wait(done, grace + 5.0)  # in-flight calls deliver what they took; the checkpoint holds what they acked
        if self.service is not None:  # same-host calls end too: the final checkpoint holds what they acked
            self.service.close_local_lane()
        # Learner sessions end once no Select is answering (a session closed under one would drop what it took).
        self._shutdown_data_planes()
        if self.ingest is not None:
            self.ingest.stop()  # workers end, reserved slots go back before the final checkpoint
        self.ops.final_checkpoint()
        self._close_tables()  # calls still waiting on a table end (TableClosedError)
        if done is not None:
            _wait(done, grace + 5.0)
        self._stop_server(0)
        self._release()
        self.ops.stopped()
        log.info("stopped in %.2f s", time.monotonic() - started)

    def _stop_server(self, grace: float) -> None:
        """Stop the server (if it started), the event loop and the table pool."""
        if self.loop is not None:
            if self.server is not None and self.loop.alive:
                try:
                    self.loop.run(self.server.stop(grace), timeout=grace + 5.0)
                except Exception:  # noqa: BLE001 (stopping anyway)
                    log.exception("stopping the gRPC server failed")
            self.loop.stop()
        if self.calls is not None:
            self.calls.shutdown()

    def _stop_sampling(self) -> None:
        """The drain's first step: no table takes a sample any more (what a call already took is delivered)."""
        for table in self.tables.values():
            try:
                table.stop_sampling()
            except Exception:  # noqa: BLE001 (keep draining the others)
                log.exception("stopping samples of table '%s' failed", getattr(table, "name", "?"))

    def _shutdown_data_planes(self) -> None:
        planes = self.service.data_planes if self.service is not None else None
        if planes is not None:
            planes.shutdown()

    def _close_tables(self) -> None:
        """Close every table: blocked calls end with TableClosedError, segments are released."""
        for table in self.tables.values():
            try:
                table.close()
            except Exception:  # noqa: BLE001 (keep closing the others)
                log.exception("closing table '%s' failed", getattr(table, "name", "?"))

    def _release(self) -> None:
        if self.store is not None:
            self.store.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the daemon has stopped; False if the timeout passed first."""
        return self._stopped.wait(timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def serve(self, install_signal_handlers: bool = True, on_started=None) -> None:
        """Start, run until ``request_stop()`` (or SIGTERM/SIGINT), then stop cleanly."""
        previous = {}
        received: list[int] = []
        if install_signal_handlers:
            def on_signal(signum, frame):
                # Only a list append: the handler runs in the main thread between bytecodes, maybe
                # inside _stop_requested.wait() holding its condition's (non-reentrant) lock, where
                # Event.set() (or logging) would deadlock: the main loop below sees the signal.
                received.append(signum)

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            self.start()
            if on_started is not None:
                on_started(self)
            while not received and not self._stop_requested.wait(0.2):
                pass
            if received:
                log.info("received %s", signal.Signals(received[0]).name)
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def address(self, host: str = "localhost") -> str:
        return f"{host}:{self.port}"


def _wait(future, timeout: float) -> None:
    """Wait for a concurrent future, whatever it ends with."""
    try:
        future.result(timeout)
    except Exception:  # noqa: BLE001 (a timeout or a failed stop: the caller goes on stopping)
        pass
