"""The daemon's operations concerns wired together: restore, checkpoints, health, metrics, auth, notify.

``Daemon`` calls one ``Operations`` at its lifecycle steps:

* ``restore(tables, make_table)`` after the tables are built: the newest good
  checkpoint replaces them (falling back to older ones, logging why);
* ``interceptors(limits)``, ``add_services(server)`` and ``server_credentials()``
  while it builds and binds the gRPC server (RPC counting, token check, call
  limits and request parsing, health and reflection, TLS);
* ``started(daemon)`` once the port serves: health SERVING, ``READY=1`` to
  systemd, the metrics endpoint, periodic checkpoints;
* ``stopping()`` first thing in ``stop()``, ``final_checkpoint()`` after the
  server stopped taking calls and before the tables close, ``stopped()`` last.

A daemon built from a bare ServerConfig (the Python ``Server``) has no
operations sections: it checkpoints only when asked (Reverb's behaviour),
serves health and reflection, and has no token, TLS or metrics endpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import text_format
from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_server.checkpoint.checkpointer import Checkpointer, CheckpointError, CheckpointSettings, TableState
from gear_server.data_planes.manager import DataPlaneManager
from gear_server.errors import CheckpointConfigConflict
from gear_server.ops import health, sd_notify
from gear_server.ops.auth import AuthSettings, TokenCheck
from gear_server.ops.logs import ErrorSummary, LoggingSettings
from gear_server.ops.metrics import MetricsServer, MetricsSettings, ServerMetrics
from gear_server.rpc.interceptors import CallGuard, RpcObserver
from gear_server.rpc.limits import LimitSettings

log = logging.getLogger("gear_server.daemon_ops")


def table_state(table: Any) -> TableState:
    """A table's checkpoint entry: its config and its snapshot's arrays and scalars."""
    snapshot = table.snapshot()
    return TableState(config=table.config, state={"arrays": snapshot.arrays, "scalars": snapshot.scalars})


def restore_table(table: Any, state: TableState) -> None:
    """Load a checkpoint entry into an empty table."""
    from gear_server.table.table import TableSnapshot

    tree = state.state
    if not isinstance(tree, dict) or not isinstance(tree.get("arrays"), dict) or \
            not isinstance(tree.get("scalars"), dict):
        raise CheckpointError(f"table '{state.config.name}': the checkpoint entry has no arrays/scalars")
    table.restore(TableSnapshot(arrays=tree["arrays"], scalars=tree["scalars"]))


def _differences(a: pb.TableConfig, b: pb.TableConfig) -> list[str]:
    return [f.name for f in pb.TableConfig.DESCRIPTOR.fields
            if f.name not in PLACEMENT_FIELDS and getattr(a, f.name) != getattr(b, f.name)]


# Where a table's items live besides its segment: the configured choice (applied at restore, not logged).
PLACEMENT_FIELDS = ("gpu_mirror",)


# Table settings a restored table cannot take from a changed config: the selectors' state and the
# items' layout were written for the checkpointed ones. Every other field applies at restore.
_FIXED_BY_CHECKPOINT = ("sampler", "remover", "signature")


def _describe(config: pb.TableConfig, field: str) -> str:
    """One field of a table config, short and on one line (for log lines and refusals)."""
    value = getattr(config, field)
    if field in ("sampler", "remover"):
        kind = value.WhichOneof("distribution") or "none"
        return f"prioritized(exponent={value.prioritized.priority_exponent:g})" if kind == "prioritized" else kind
    if field == "signature":
        if not config.HasField("signature"):
            return "none"
        leaves = [f"{leaf.name} {np.dtype(leaf.dtype).name}{list(leaf.shape)}" for leaf in value.leaves]
        text = "{" + ", ".join(leaves) + "}"
        return text if len(text) <= 160 else text[:157] + "..."
    if isinstance(value, int | float | str):
        return str(value)
    text = text_format.MessageToString(value, as_one_line=True)
    return text if len(text) <= 160 else text[:157] + "..."


def config_conflicts(state: TableState, configured: pb.TableConfig) -> list[str]:
    """What in ``configured`` cannot apply to the checkpointed table ``state`` (one line each; empty: restorable)."""
    name = state.config.name
    out = [f"table '{name}' {field} is {_describe(configured, field)} in the config, "
           f"{_describe(state.config, field)} in the checkpoint"
           for field in _FIXED_BY_CHECKPOINT if getattr(state.config, field) != getattr(configured, field)]
    scalars = state.state.get("scalars", {}) if isinstance(state.state, dict) else {}
    items = int(scalars.get("num_items", 0))
    if configured.max_size < items:
        out.append(f"table '{name}' max_size is {configured.max_size} in the config, but the checkpoint holds "
                   f"{items} items")
    return out


class Operations:
    """Checkpoints, health, metrics, auth/TLS, sd_notify and the failed-call summary of one daemon."""

    def __init__(self, settings: Any) -> None:
        server: pb.ServerConfig = settings.server
        self.checkpoint_settings = CheckpointSettings.effective(
            settings.checkpoint, server) if settings.checkpoint is not None else \
            CheckpointSettings(dir=server.checkpoint_dir or None, on_stop=False,
                               fallback_path=getattr(server, "fallback_checkpoint_path", "") or None)
        self.auth: AuthSettings = settings.auth or AuthSettings()
        self.metrics_settings: MetricsSettings = settings.metrics or MetricsSettings()
        self.logging: LoggingSettings = settings.logging or LoggingSettings()
        self.source: str | None = getattr(settings, "source", None)  # the config file, named in refusals
        self._tables: Mapping[str, Any] = {}
        self.metrics = ServerMetrics(tables=lambda: self._tables)
        self.errors = ErrorSummary(self.logging.client_error_summary_s)
        cs = self.checkpoint_settings
        # A relative dir resolves against the working directory (/var/lib/gear under the unit).
        self.checkpointer = Checkpointer(Path(cs.dir).expanduser().absolute(), keep=cs.keep) if cs.dir else None
        if settings.checkpoint is not None and self.checkpointer is None:
            log.warning("[checkpoint] names no dir: checkpoints are off")
        self.health: health.Health | None = None
        self.token: TokenCheck | None = self.auth.token_check()
        self.metrics_server: MetricsServer | None = None
        self.restored_from: Path | None = None
        self._periodic: threading.Thread | None = None
        self._stop = threading.Event()
        self._final_done = False

    # ------------------------------------------------------------------ start
    def restore(self, tables: dict[str, Any], make_table: Callable[[pb.TableConfig], Any]) -> dict[str, Any]:
        """Replace ``tables`` with the newest good checkpoint's; returns the tables to serve.

        A checkpointed table takes the configured rate limiter, max_size and
        max_times_sampled; a changed sampler, remover or signature (the
        selectors' state and the items' layout hold only with the checkpointed
        ones), or a max_size below the items held, refuses the start
        (CheckpointConfigConflict naming each difference and the ways out). A
        configured table missing from the checkpoint starts empty. Logs one
        line per table.
        """
        served = self._restore(tables, make_table)
        for name, table in served.items():
            config = table.config
            log.info("table %s: sampler=%s remover=%s max_size=%d max_times_sampled=%d items=%d", name,
                     config.sampler.WhichOneof("distribution"), config.remover.WhichOneof("distribution"),
                     config.max_size, config.max_times_sampled, table.size())
        return served

    def _restore(self, tables: dict[str, Any], make_table: Callable[[pb.TableConfig], Any]) -> dict[str, Any]:
        self._tables = tables
        cs = self.checkpoint_settings
        if self.checkpointer is None:
            return tables
        try:  # a directory that cannot be written is a configuration error: stop now, not at the first checkpoint
            self.checkpointer.create_root()  # 0700, whatever the umask
        except OSError as exc:
            raise OSError(exc.errno, f"checkpoint dir {self.checkpointer.root}: {exc.strerror}") from exc
        self.checkpointer.lock_dir()  # one daemon per directory: another's rotation would remove ours
        if not cs.restore:
            return tables
        removed = self.checkpointer.cleanup_interrupted()
        if removed:
            log.warning("removed %d checkpoint(s) a crash interrupted: %s", len(removed),
                        ", ".join(p.name for p in removed))
        sd_notify.status(f"restoring checkpoints from {self.checkpointer.root}")
        started = time.monotonic()

        def apply(path: Path, states: list[TableState]) -> dict[str, Any]:
            conflicts = [line for state in states if state.config.name in tables
                         for line in config_conflicts(state, tables[state.config.name].config)]
            if conflicts:
                raise CheckpointConfigConflict(self._conflict_message(path, conflicts))
            built: dict[str, Any] = {}
            freed: list[str] = []  # configured tables closed first: their GPU mirror's memory is taken again
            try:
                for state in states:
                    name = state.config.name
                    configured = tables.get(name)
                    config = state.config if configured is None else configured.config
                    applied = _differences(state.config, config)
                    if applied:
                        log.info("table '%s': the configured %s applied to the restored items", name,
                                 ", ".join(f"{field} ({_describe(state.config, field)} -> "
                                           f"{_describe(config, field)})" for field in applied))
                    if configured is not None and configured.mirror is not None:
                        configured.close()
                        freed.append(name)
                    built[name] = make_table(config)
                    restore_table(built[name], state)
            except BaseException:
                for table in built.values():
                    table.close()
                for name in freed:  # serve the configured (empty) table again if this checkpoint is not used
                    tables[name] = make_table(tables[name].config)
                raise
            return built

        found = self.checkpointer.load_latest(cs.fallback_path, apply=apply)
        if found is None:
            log.info("no checkpoint to restore in %s: starting with empty tables", self.checkpointer.root)
            return tables
        path, restored = found
        for name, table in tables.items():
            if name in restored:
                table.close()
        extra = sorted(set(restored) - set(tables))
        if extra:
            log.warning("tables restored from the checkpoint but absent from the config: %s", ", ".join(extra))
        merged = {name: restored.get(name, table) for name, table in tables.items()}
        merged.update({name: restored[name] for name in extra})
        self._tables = merged
        self.restored_from = path
        items = sum(t.size() for t in restored.values())
        log.info("restored checkpoint path=%s tables=%d items=%d seconds=%.3f", path, len(restored), items,
                 time.monotonic() - started)
        return merged

    def _conflict_message(self, path: Path, conflicts: list[str]) -> str:
        source = self.source or "the configuration"
        return (f"the checkpoint {path} cannot be restored under the configured tables: "
                + "; ".join(conflicts)
                + f". Either set these back in {source} to the checkpoint's values, or start without its items "
                  f"(move the checkpoints out of {self.checkpointer.root}, or set restore = false in "
                  f"[checkpoint]); rate limiter, max_size and max_times_sampled changes are applied at restore")

    def attach_data_planes(self, manager: DataPlaneManager) -> None:
        """Count the manager's selections and read its open sessions for the metrics."""
        manager.metrics = self.metrics
        self.metrics.watch_sessions(manager.sessions.counts_by_kind)

    def interceptors(self, limits: LimitSettings) -> list[aio.ServerInterceptor]:
        """RPC counting first (it sees refused calls too), then the token check, then call limits and parsing."""
        return [RpcObserver(self.metrics, on_error=self.errors.record),
                *self.auth.interceptors(self.metrics.auth_denied, self.token), CallGuard(limits)]

    def add_services(self, server: aio.Server) -> None:
        """Health (NOT_SERVING until ``started``) and reflection; on the server's event loop."""
        self.health = health.add_to_server(server, [health.REPLAY_SERVICE], self.token)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        return self.auth.server_credentials()

    def started(self, daemon: Any) -> None:
        """The port serves: tell probes and systemd, open the metrics endpoint, start periodic checkpoints."""
        self._tables = daemon.tables
        if self.metrics_settings.enabled:
            ms = self.metrics_settings
            self.metrics_server = MetricsServer(self.metrics.registry, ms.bind, ms.port)
            log.info("metrics at http://%s:%d/metrics", ms.bind, self.metrics_server.port)
        log.info("security: %s", self.auth.describe())
        cs = self.checkpoint_settings
        if self.checkpointer is not None and cs.interval_s > 0:
            self._periodic = threading.Thread(target=self._every, args=(cs.interval_s,),
                                              name="gear-checkpoints", daemon=True)
            self._periodic.start()
        self.errors.start()
        if self.health is not None:
            self.health.set_all(health.SERVING)
        sd_notify.ready(f"serving {len(daemon.tables)} table(s) on port {daemon.port}")

    def start_failed(self) -> None:
        """The start failed after (some of) ``started``: end what it began; no checkpoint is written."""
        self._stop.set()
        self._final_done = True
        if self._periodic is not None:
            self._periodic.join()
        self.stopped()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> str:
        """Write a checkpoint of every table now; returns its path (the Checkpoint RPC)."""
        if self.checkpointer is None:
            raise ValueError("no checkpoint directory is configured")
        started = time.monotonic()
        try:
            path = self.checkpointer.write(table_state(t) for t in list(self._tables.values()))
        except Exception:
            self.metrics.checkpoint_failed()
            raise
        self.metrics.checkpoint_written(time.monotonic() - started, self.checkpointer.last_written_bytes)
        return str(path)

    def checkpoint_function(self) -> Callable[[], str] | None:
        return self.checkpoint if self.checkpointer is not None else None

    def _every(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.checkpoint()
            except Exception as exc:  # keep serving; the next period tries again
                log.error("periodic checkpoint failed: %s", exc)

    # ------------------------------------------------------------------ stop
    def stopping(self) -> None:
        if self.health is not None:
            self.health.shutdown()
        self._stop.set()
        sd_notify.stopping("final checkpoint" if self._wants_final() else "stopping")

    def _wants_final(self) -> bool:
        return self.checkpointer is not None and self.checkpoint_settings.on_stop

    def final_checkpoint(self) -> str | None:
        """The checkpoint taken on the way down (SIGTERM, stop()), when configured."""
        if not self._wants_final() or self._final_done:
            return None
        self._final_done = True
        if self._periodic is not None:
            self._periodic.join()  # a periodic checkpoint in progress finishes first
        try:
            return self.checkpoint()
        except Exception as exc:
            log.error("final checkpoint failed: %s", exc)
            return None

    def stopped(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.unlock_dir()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        self.errors.stop()

