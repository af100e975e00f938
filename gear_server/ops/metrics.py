"""The daemon's Prometheus metrics (prometheus_client) and the ``/metrics`` endpoint.

Hot paths (inserts, samples, selections) update children looked up once per
table; values that already live elsewhere (table sizes, rate-limiter waits,
open data-plane sessions) are read only when Prometheus scrapes. Every label
takes its values from a bounded set, so no caller (with or without the token)
can add series: RPC methods the daemon does not serve count under
``method="unknown"``, status codes are gRPC's, planes are the three data
planes, tables are the daemon's own (at most ``MAX_TABLE_LABELS``, the rest
under ``table="other"``). Series exist at zero from the start (every table,
plane, checkpoint result and served method), so rates and alerts work before
the first event. The endpoint listens on ``[metrics] bind`` (localhost by
default; docs/SECURITY.md says what a scrape reveals).
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from gear_contract._proto import replay_pb2 as pb
from gear_contract.negotiation import PLANES
from gear_server import __version__
from gear_server.config import known_keys

log = logging.getLogger(__name__)

# Latency buckets in seconds: 50 us .. 10 s (selection is micro- to milliseconds,
# transfers of large batches up to seconds).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
DEFAULT_BIND = "127.0.0.1"
UNKNOWN_METHOD = "unknown"
OTHER_TABLE = "other"
UNKNOWN_PLANE = "unknown"
MAX_TABLE_LABELS = 256  # distinct table label values; later tables count under "other"
STATUS_CODES = frozenset(code.name for code in grpc.StatusCode)
CHECKPOINT_RESULTS = ("ok", "failed")
# The standard services the daemon serves beside its own (health checks, reflection).
STANDARD_METHODS = (
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
)


def _served_methods() -> dict[str, str]:
    """Full method path -> its label (the method's short name) for every method the daemon serves."""
    paths = [f"/{service.full_name}/{method.name}"
             for service in pb.DESCRIPTOR.services_by_name.values() for method in service.methods]
    return {path: path.rsplit("/", 1)[-1] for path in (*paths, *STANDARD_METHODS)}


METHOD_LABELS = _served_methods()
_LABEL_OF = {**METHOD_LABELS, **{label: label for label in METHOD_LABELS.values()}}


def method_label(method: str) -> str:
    """The ``method`` label of an RPC given by full path or short name: ``unknown`` for any other name."""
    return _LABEL_OF.get(method, UNKNOWN_METHOD)


def code_label(code: grpc.StatusCode | str | None) -> str:
    """The ``code`` label: a gRPC status code name (anything else counts as UNKNOWN)."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    return code if code in STATUS_CODES else "UNKNOWN"


def plane_label(plane: str) -> str:
    return plane if plane in PLANES else UNKNOWN_PLANE


@dataclass(frozen=True)
class MetricsSettings:
    """The ``[metrics]`` section: where the Prometheus endpoint listens (off without the section)."""

    enabled: bool = False
    bind: str = DEFAULT_BIND  # localhost: a scrape answers without the token (docs/SECURITY.md)
    port: int = 9580  # 0: any free port (logged at start)

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> MetricsSettings:
        """A present section turns metrics on unless it says ``enabled = false``."""
        if section is None:
            return cls()
        section = known_keys(section, cls.__dataclass_fields__, "[metrics]")
        enabled = section.get("enabled", True)
        bind = section.get("bind", cls.bind)
        port = section.get("port", cls.port)
        if not isinstance(enabled, bool):
            raise ValueError(f"[metrics] enabled must be true or false, got {enabled!r}")
        if not isinstance(bind, str) or not bind:
            raise ValueError(f"[metrics] bind must be a host address, got {bind!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"[metrics] port must be an integer in 0..65535, got {port!r}")
        return cls(enabled=enabled, bind=bind.strip("[]"), port=port)


class _Table(Protocol):
    """What the metrics read from a table: its info() (sizes, rate-limiter statistics)."""

    def info(self) -> pb.TableInfo: ...


class _TableSeries:
    """The hot-path children of one table label, looked up once."""

    __slots__ = ("label", "inserts", "bytes_in", "samples", "bytes_out", "selection", "transfer")

    def __init__(self, metrics: ServerMetrics, table: str) -> None:
        self.label = table
        self.inserts = metrics.inserts.labels(table)
        self.bytes_in = metrics.bytes_in.labels(table)
        self.samples = metrics.samples.labels(table)
        self.bytes_out = {plane: metrics.bytes_out.labels(table, plane) for plane in PLANES}
        self.selection = metrics.selection.labels(table)
        self.transfer = {plane: metrics.transfer.labels(table, plane) for plane in PLANES}


class ServerMetrics:
    """The daemon's metrics, with one cheap method per event; label values are bounded here."""

    def __init__(self, tables: Callable[[], Mapping[str, _Table]] | None = None) -> None:
        """``tables`` returns the live {name: Table} (sizes and rate-limiter waits are read from it)."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._tables = tables
        self._sessions: Callable[[], Mapping[str, int]] | None = None
        self._per_table: dict[str, _TableSeries] = {}
        # Children of the RPC metrics by label values (bounded), looked up without labels()' lock.
        self._rpc_children: dict[tuple[str, str], Any] = {}
        self._duration_children: dict[str, Any] = {}
        self._lock = threading.Lock()
        r.register(_ScrapeTimeCollector(self))  # first: it also creates the series of new tables at zero
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Info("gear_build", "The daemon's build.", registry=r).info(
            {"version": __version__, "python": platform.python_version(), "grpcio": grpc.__version__})
        self.inserts = Counter("gear_inserts_total", "Items inserted.", ["table"], registry=r)
        self.samples = Counter("gear_samples_total", "Items sampled (every data plane).", ["table"], registry=r)
        self.bytes_in = Counter("gear_bytes_received_total", "Item bytes received by inserts.", ["table"],
                                registry=r)
        self.bytes_out = Counter("gear_bytes_sent_total",
                                 "Item bytes sent by inline samples or handed out by reference (shm, rdma).",
                                 ["table", "plane"], registry=r)
        self.selection = Histogram("gear_selection_latency_seconds",
                                   "Time to select a batch of items, rate limiter wait included (the whole "
                                   "table.sample call).", ["table"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer = Histogram("gear_transfer_latency_seconds",
                                  "Time to move a sampled batch out of the table (inline: read and encode).",
                                  ["table", "plane"], buckets=LATENCY_BUCKETS, registry=r)
        self.sessions_opened = Counter("gear_data_plane_sessions_opened_total",
                                       "Data-plane negotiations answered, by the plane agreed.", ["plane"],
                                       registry=r)
        self.rpcs = Counter("gear_rpcs_total", "RPCs finished, by method (unknown: a method the daemon does not "
                            "serve) and status code.", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("gear_rpc_duration_seconds", "Time from a call's start to its end (streams: "
                                     "the whole stream).", ["method"], registry=r,
                                     buckets=(1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 60.0, 600.0))
        self.denied = Counter("gear_auth_denied_total", "Calls refused for a missing or wrong token, by method.",
                              ["method"], registry=r)
        self.checkpoints = Counter("gear_checkpoints_total", "Checkpoints attempted, by result.", ["result"],
                                   registry=r)
        self.checkpoint_seconds = Histogram("gear_checkpoint_duration_seconds", "Time to write a checkpoint.",
                                            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900), registry=r)
        self.checkpoint_bytes = Gauge("gear_last_checkpoint_bytes", "Size of the last checkpoint written.",
                                      registry=r)
        self.checkpoint_time = Gauge("gear_last_checkpoint_timestamp_seconds",
                                     "Unix time of the last checkpoint written.", registry=r)
        Gauge("gear_start_time_seconds", "Unix time the daemon started.", registry=r).set(time.time())
        # Series at zero: every plane, checkpoint result and served method.
        for plane in PLANES:
            self.sessions_opened.labels(plane)
        for result in CHECKPOINT_RESULTS:
            self.checkpoints.labels(result)
        for label in sorted(set(METHOD_LABELS.values())):
            self.rpcs.labels(label, "OK")
            self.denied.labels(label)
        self.denied.labels(UNKNOWN_METHOD)

    # -- label bounds -------------------------------------------------------------

    def _series(self, table: str) -> _TableSeries:
        """The children of ``table`` (created at zero on first use; past MAX_TABLE_LABELS: "other")."""
        series = self._per_table.get(table)
        if series is None:
            with self._lock:
                series = self._per_table.get(table)
                if series is None:
                    if len(self._per_table) >= MAX_TABLE_LABELS:
                        series = self._per_table.get(OTHER_TABLE) or _TableSeries(self, OTHER_TABLE)
                        self._per_table.setdefault(OTHER_TABLE, series)
                    else:
                        series = self._per_table[table] = _TableSeries(self, table)
        return series

    # -- hot path -------------------------------------------------------------

    def inserted(self, table: str, items: int, nbytes: int) -> None:
        series = self._series(table)
        series.inserts.inc(items)
        series.bytes_in.inc(nbytes)

    def sampled(self, table: str, items: int, nbytes: int, plane: str = "inline") -> None:
        series = self._series(table)
        series.samples.inc(items)
        bytes_out = series.bytes_out.get(plane)
        if bytes_out is None:
            bytes_out = self.bytes_out.labels(series.label, UNKNOWN_PLANE)
        bytes_out.inc(nbytes)

    def item_inserted(self, table: str, columns: Sequence[Any]) -> None:
        """One item in (its bytes counted from its columns: arrays or lists of chunk slices)."""
        nbytes = 0
        for column in columns:
            nbytes += column.nbytes if hasattr(column, "nbytes") else sum(part.nbytes for part in column)
        self.items_inserted(table, 1, nbytes)

    def items_inserted(self, table: str, items: int, nbytes: int) -> None:
        """Items in, with their bytes (the insert plane counts a commit's items at once)."""
        series = self._per_table.get(table) or self._series(table)
        series.inserts.inc(items)
        series.bytes_in.inc(nbytes)

    def sample_served(self, table: str, items: int, nbytes: int, select_s: float, transfer_s: float) -> None:
        """One inline SampleResponse: selection and read+encode times, items and bytes sent."""
        series = self._per_table.get(table) or self._series(table)
        series.samples.inc(items)
        series.bytes_out["inline"].inc(nbytes)
        series.selection.observe(select_s)
        series.transfer["inline"].observe(transfer_s)

    def plane_selected(self, table: Any, plane: str, selection: Any, select_s: float) -> None:
        """One data-plane Select: items handed out by reference; bytes are what the learner may read."""
        items = len(selection.slots)
        nbytes = 0
        layout = table.layout()
        if layout is not None and items:
            lengths = selection.lengths.reshape(items, -1).sum(axis=0)
            nbytes = int(sum(int(n) * c.step_bytes for n, c in zip(lengths, layout.columns, strict=False)))
        self.sampled(table.name, items, nbytes, plane)
        self._series(table.name).selection.observe(select_s)

    def plane_opened(self, plane: str) -> None:
        self.sessions_opened.labels(plane_label(plane)).inc()

    def watch_sessions(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Report ``counts()`` (open data-plane sessions by plane) at every scrape."""
        self._sessions = counts

    def observe_selection(self, table: str, seconds: float) -> None:
        self._series(table).selection.observe(seconds)

    def observe_transfer(self, table: str, plane: str, seconds: float) -> None:
        transfer = self._series(table).transfer.get(plane)
        if transfer is not None:
            transfer.observe(seconds)

    # -- calls ------------------------------------------------------------------

    def observe_rpc(self, method: str, code: grpc.StatusCode | str | None, seconds: float | None = None) -> None:
        """One finished RPC (method by full path or short name; unknown methods count as ``unknown``)."""
        label = method_label(method)
        key = (label, code_label(code))
        counter = self._rpc_children.get(key)
        if counter is None:  # at most (served methods + 1) x 17 codes
            counter = self._rpc_children[key] = self.rpcs.labels(*key)
        counter.inc()
        if seconds is not None:
            timer = self._duration_children.get(label)
            if timer is None:
                timer = self._duration_children[label] = self.rpc_seconds.labels(label)
            timer.observe(seconds)

    def rpc_finished(self, method: str, code: str) -> None:
        self.observe_rpc(method, code)

    def auth_denied(self, method: str) -> None:
        """One call refused by the token check."""
        self.denied.labels(method_label(method)).inc()

    # -- checkpoints --------------------------------------------------------------

    def checkpoint_written(self, seconds: float, nbytes: int) -> None:
        self.checkpoints.labels("ok").inc()
        self.checkpoint_seconds.observe(seconds)
        self.checkpoint_bytes.set(nbytes)
        self.checkpoint_time.set(time.time())

    def checkpoint_failed(self) -> None:
        self.checkpoints.labels("failed").inc()

    # -- scrape-time reads ----------------------------------------------------

    def infos(self) -> list[tuple[str, pb.TableInfo]]:
        """(name, info) of every live table (a closed one is skipped this scrape)."""
        if self._tables is None:
            return []
        out = []
        for name, table in list(self._tables().items()):
            try:
                out.append((name, table.info()))
            except Exception as exc:  # noqa: BLE001 (a closed table: skip it this scrape)
                log.debug("no info for table %s: %s", name, exc)
        return out

    def session_counts(self) -> Mapping[str, int]:
        return self._sessions() if self._sessions is not None else {}

    def render(self) -> bytes:
        """The text exposition of every metric (what ``/metrics`` answers)."""
        return generate_latest(self.registry)


class _ScrapeTimeCollector(Collector):
    """Values read when Prometheus scrapes: table sizes, rate-limiter statistics, open sessions.

    It also creates the hot-path series of tables that appeared since the last
    scrape, so a new table's counters show at zero.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []  # read live at every scrape

    def collect(self) -> Iterable[Metric]:
        m = self._metrics
        infos = m.infos()[:MAX_TABLE_LABELS]
        for name, _ in infos:
            m._series(name)
        size = GaugeMetricFamily("gear_table_size", "Items in the table.", labels=["table"])
        capacity = GaugeMetricFamily("gear_table_max_size", "Table capacity in items.", labels=["table"])
        episodes = GaugeMetricFamily("gear_table_episodes", "Episodes with items in the table.", labels=["table"])
        waits = CounterMetricFamily("gear_rate_limiter_wait_seconds",
                                    "Time calls spent blocked by the rate limiter (completed and still pending).",
                                    labels=["table", "op"])
        limited = CounterMetricFamily("gear_rate_limiter_limited", "Calls that had to wait for the rate limiter.",
                                      labels=["table", "op"])
        deleted = CounterMetricFamily("gear_items_deleted", "Items removed (remover, max_times_sampled, deletes).",
                                      labels=["table"])
        mirror_bytes = GaugeMetricFamily("gear_gpu_mirror_bytes", "GPU memory held by the table's GPU mirror.",
                                         labels=["table", "device"])
        mirror_items = GaugeMetricFamily("gear_gpu_mirror_items", "Items the table's GPU mirror holds now.",
                                         labels=["table", "device"])
        for name, info in infos:
            if info.HasField("gpu_mirror"):
                gm = info.gpu_mirror
                mirror_bytes.add_metric([name, str(gm.device)], gm.budget_bytes)
                mirror_items.add_metric([name, str(gm.device)], gm.mirrored_items)
            rl = info.rate_limiter_info
            size.add_metric([name], info.current_size)
            capacity.add_metric([name], info.max_size)
            episodes.add_metric([name], info.num_episodes)
            deleted.add_metric([name], rl.num_deletes)
            for op, stats in (("insert", rl.insert_stats), ("sample", rl.sample_stats)):
                waits.add_metric([name, op], stats.completed_wait_time_s + stats.pending_wait_time_s)
                limited.add_metric([name, op], stats.limited)
        sessions = GaugeMetricFamily("gear_data_plane_sessions", "Open data-plane sessions by plane.",
                                     labels=["plane"])
        counts = dict(m.session_counts())
        for plane in PLANES:
            sessions.add_metric([plane], counts.get(plane, 0))
        return [size, capacity, episodes, waits, limited, deleted, sessions, mirror_bytes, mirror_items]


class MetricsServer:
    """The ``/metrics`` endpoint (prometheus_client's HTTP server) in a background thread."""

    def __init__(self, registry: CollectorRegistry, bind: str = DEFAULT_BIND, port: int = 0) -> None:
        try:
            self._http, self._thread = start_http_server(port, addr=bind.strip("[]"), registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"metrics endpoint cannot listen on {bind}:{port}: {exc.strerror}") from exc
        self.port = self._http.server_address[1]
        self.bind = bind

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
