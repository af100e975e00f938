"""Prometheus metrics without prometheus_client: counters, gauges, histograms, an HTTP endpoint.

The hot paths (inserts, samples, selections) pay one dict lookup and one lock
per update; values that already live elsewhere (table sizes, rate-limiter wait
times) are read only when Prometheus scrapes, through callbacks. The endpoint
serves the text exposition format (version 0.0.4) at ``/metrics`` from a small
``http.server`` thread on the port the ``[metrics]`` config section names.
"""

from __future__ import annotations

import bisect
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from gear_server.config import known_keys

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Latency buckets in seconds: 50 us .. 10 s (selection is micro- to milliseconds,
# transfers of large batches up to seconds).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


@dataclass(frozen=True)
class MetricsSettings:
    """The ``[metrics]`` section: where the Prometheus endpoint listens (off without the section)."""

    enabled: bool = False
    bind: str = "0.0.0.0"
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
        return cls(enabled=enabled, bind=bind, port=port)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


class _Value:
    """One labelled series of a counter or gauge."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _HistogramValue:
    """One labelled series of a histogram: cumulative buckets are computed at scrape time."""

    __slots__ = ("_lock", "_bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self.counts[index] += 1
            self.sum += value
            self.count += 1

    def time(self) -> _Timer:
        """``with hist.labels(...).time(): ...`` observes the block's duration."""
        return _Timer(self)

    def snapshot(self) -> tuple[list[int], float, int]:
        with self._lock:
            return list(self.counts), self.sum, self.count


class _Timer:
    __slots__ = ("_hist", "_start")

    def __init__(self, hist: _HistogramValue) -> None:
        self._hist = hist

    def __enter__(self) -> _Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._hist.observe(time.perf_counter() - self._start)


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()

    def _new(self):
        raise NotImplementedError

    def labels(self, *values: str):
        """The series for these label values (created on first use)."""
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            with self._lock:
                series = self._series.setdefault(values, self._new())
        return series

    def remove(self, *values: str) -> None:
        with self._lock:
            self._series.pop(values, None)

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        with self._lock:
            return list(self._series.items())

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for values, series in self._items():
            yield f"{self.name}{_labels(self.labelnames, values)} {_number(series.value)}"


class Counter(_Metric):
    """Monotonic count (names end in ``_total``)."""

    kind = "counter"

    def _new(self) -> _Value:
        return _Value()

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)


class Gauge(_Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def _new(self) -> _Value:
        return _Value()

    def set(self, value: float) -> None:
        self.labels().set(value)


class Histogram(_Metric):
    """Observations counted into fixed buckets (seconds for latencies)."""

    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))

    def _new(self) -> _HistogramValue:
        return _HistogramValue(self.buckets)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for values, series in self._items():
            counts, total, count = series.snapshot()
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.labelnames, values, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.labelnames, values)} {_number(total)}"
            yield f"{self.name}_count{_labels(self.labelnames, values)} {count}"


class Callback(_Metric):
    """Series read at scrape time: ``fn() -> iterable of (label values, value)``."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], kind: str,
                 fn: Callable[[], Iterable[tuple[Sequence[str], float]]]) -> None:
        super().__init__(name, help, labelnames)
        self.kind = kind
        self._fn = fn

    def render(self) -> Iterable[str]:
        try:
            rows = list(self._fn())
        except Exception as exc:  # a failing callback must not break the whole scrape
            log.warning("metrics callback %s failed: %s", self.name, exc)
            rows = []
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for values, value in rows:
            values = (values,) if isinstance(values, str) else tuple(values)
            yield f"{self.name}{_labels(self.labelnames, values)} {_number(value)}"


class Registry:
    """Named metrics rendered together in the text exposition format."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def add(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} registered twice")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.add(Counter(name, help, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self.add(Gauge(name, help, labelnames))  # type: ignore[return-value]

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self.add(Histogram(name, help, labelnames, buckets))  # type: ignore[return-value]

    def callback(self, name: str, help: str, labelnames: Sequence[str], kind: str,
                 fn: Callable[[], Iterable[tuple[Sequence[str], float]]]) -> Callback:
        return self.add(Callback(name, help, labelnames, kind, fn))  # type: ignore[return-value]

    def remove(self, name: str) -> None:
        with self._lock:
            self._metrics.pop(name, None)

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        lines: list[str] = []
        for metric in metrics:
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class _TableSeries:
    """The hot-path series of one table, looked up once (a dict get per event instead of six)."""

    __slots__ = ("inserts", "bytes_in", "samples", "bytes_inline", "selection", "transfer_inline")

    def __init__(self, inserts, bytes_in, samples, bytes_inline, selection, transfer_inline) -> None:
        self.inserts, self.bytes_in, self.samples = inserts, bytes_in, samples
        self.bytes_inline, self.selection, self.transfer_inline = bytes_inline, selection, transfer_inline


class ServerMetrics:
    """The daemon's metrics, with one cheap method per hot-path event."""

    def __init__(self, tables: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """``tables`` returns the live {name: Table} (sizes and rate-limiter waits are read from it)."""
        r = self.registry = Registry()
        self._tables = tables
        self._per_table: dict[str, _TableSeries] = {}
        self.inserts = r.counter("gear_inserts_total", "Items inserted.", ["table"])
        self.samples = r.counter("gear_samples_total", "Items sampled (every data plane).", ["table"])
        self.bytes_in = r.counter("gear_bytes_received_total", "Item bytes received by inserts.", ["table"])
        self.bytes_out = r.counter("gear_bytes_sent_total",
                                   "Item bytes sent by inline samples or handed out by reference (shm, rdma).",
                                   ["table", "plane"])
        self.selection = r.histogram("gear_selection_latency_seconds",
                                     "Time to select a batch of items (rate limiter wait excluded where known).",
                                     ["table"])
        self.transfer = r.histogram("gear_transfer_latency_seconds",
                                    "Time to move a sampled batch out of the table (inline: read and encode).",
                                    ["table", "plane"])
        self.sessions_opened = r.counter("gear_data_plane_sessions_opened_total",
                                         "Data-plane negotiations answered, by the kind agreed.", ["kind"])
        self.rpcs = r.counter("gear_rpcs_total", "RPCs finished, by method and status code.", ["method", "code"])
        self.auth_denied = r.counter("gear_auth_denied_total", "Calls refused for a missing or wrong token.",
                                     ["method"])
        self.checkpoints = r.counter("gear_checkpoints_total", "Checkpoints attempted, by result.", ["result"])
        self.checkpoint_seconds = r.histogram("gear_checkpoint_duration_seconds", "Time to write a checkpoint.",
                                              buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900))
        self.checkpoint_bytes = r.gauge("gear_last_checkpoint_bytes", "Size of the last checkpoint written.")
        self.checkpoint_time = r.gauge("gear_last_checkpoint_timestamp_seconds",
                                       "Unix time of the last checkpoint written.")
        self.started = r.gauge("gear_start_time_seconds", "Unix time the daemon started.")
        self.started.set(time.time())
        r.callback("gear_table_size", "Items in the table.", ["table"], "gauge",
                   lambda: ((name, info.current_size) for name, info in self._infos()))
        r.callback("gear_table_max_size", "Table capacity in items.", ["table"], "gauge",
                   lambda: ((name, info.max_size) for name, info in self._infos()))
        r.callback("gear_table_episodes", "Episodes with items in the table.", ["table"], "gauge",
                   lambda: ((name, info.num_episodes) for name, info in self._infos()))
        r.callback("gear_rate_limiter_wait_seconds_total",
                   "Time calls spent blocked by the rate limiter (completed and still pending).",
                   ["table", "op"], "counter", self._waits)
        r.callback("gear_rate_limiter_limited_total", "Calls that had to wait for the rate limiter.",
                   ["table", "op"], "counter", self._limited)
        r.callback("gear_items_deleted_total", "Items removed (remover, max_times_sampled, deletes).",
                   ["table"], "counter",
                   lambda: ((name, info.rate_limiter_info.num_deletes) for name, info in self._infos()))

    # -- hot path -------------------------------------------------------------

    def inserted(self, table: str, items: int, nbytes: int) -> None:
        self.inserts.labels(table).inc(items)
        self.bytes_in.labels(table).inc(nbytes)

    def sampled(self, table: str, items: int, nbytes: int, plane: str = "inline") -> None:
        self.samples.labels(table).inc(items)
        self.bytes_out.labels(table, plane).inc(nbytes)

    def _table_series(self, table: str) -> _TableSeries:
        series = self._per_table.get(table)
        if series is None:
            series = self._per_table.setdefault(table, _TableSeries(
                self.inserts.labels(table), self.bytes_in.labels(table), self.samples.labels(table),
                self.bytes_out.labels(table, "inline"), self.selection.labels(table),
                self.transfer.labels(table, "inline")))
        return series

    def item_inserted(self, table: str, columns: Sequence[Any]) -> None:
        """One item in (its bytes counted from its columns: arrays or lists of chunk slices)."""
        nbytes = 0
        for column in columns:
            nbytes += column.nbytes if hasattr(column, "nbytes") else sum(part.nbytes for part in column)
        series = self._per_table.get(table) or self._table_series(table)
        series.inserts.inc()
        series.bytes_in.inc(nbytes)

    def sample_served(self, table: str, items: int, nbytes: int, select_s: float, transfer_s: float) -> None:
        """One inline SampleResponse: selection and read+encode times, items and bytes sent."""
        series = self._per_table.get(table) or self._table_series(table)
        series.samples.inc(items)
        series.bytes_inline.inc(nbytes)
        series.selection.observe(select_s)
        series.transfer_inline.observe(transfer_s)

    def plane_selected(self, table: Any, plane: str, selection: Any, select_s: float) -> None:
        """One data-plane Select: items handed out by reference; bytes are what the learner may read."""
        items = len(selection.slots)
        nbytes = 0
        layout = table.layout()
        if layout is not None and items:
            lengths = selection.lengths.reshape(items, -1).sum(axis=0)
            nbytes = int(sum(int(n) * c.step_bytes for n, c in zip(lengths, layout.columns, strict=False)))
        self.samples.labels(table.name).inc(items)
        self.bytes_out.labels(table.name, plane).inc(nbytes)
        self.selection.labels(table.name).observe(select_s)

    def plane_opened(self, kind: str) -> None:
        self.sessions_opened.labels(kind).inc()

    def watch_sessions(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Report ``counts()`` (open data-plane sessions by kind) at every scrape."""
        self.registry.remove("gear_data_plane_sessions")
        self.registry.callback(
            "gear_data_plane_sessions", "Open data-plane sessions by kind.", ["kind"], "gauge",
            lambda: ((kind, n) for kind, n in sorted(counts().items())))

    def observe_selection(self, table: str, seconds: float) -> None:
        self.selection.labels(table).observe(seconds)

    def observe_transfer(self, table: str, plane: str, seconds: float) -> None:
        self.transfer.labels(table, plane).observe(seconds)

    def rpc_finished(self, method: str, code: str) -> None:
        self.rpcs.labels(method, code).inc()

    def checkpoint_written(self, seconds: float, nbytes: int) -> None:
        self.checkpoints.labels("ok").inc()
        self.checkpoint_seconds.observe(seconds)
        self.checkpoint_bytes.set(nbytes)
        self.checkpoint_time.set(time.time())

    def checkpoint_failed(self) -> None:
        self.checkpoints.labels("failed").inc()

    # -- scrape-time reads ----------------------------------------------------

    def _infos(self):
        if self._tables is None:
            return []
        out = []
        for name, table in list(self._tables().items()):
            try:
                out.append((name, table.info()))
            except Exception as exc:  # a closed table: skip it this scrape
                log.debug("no info for table %s: %s", name, exc)
        return out

    def _waits(self):
        for name, info in self._infos():
            rl = info.rate_limiter_info
            for op, stats in (("insert", rl.insert_stats), ("sample", rl.sample_stats)):
                yield (name, op), stats.completed_wait_time_s + stats.pending_wait_time_s

    def _limited(self):
        for name, info in self._infos():
            rl = info.rate_limiter_info
            yield (name, "insert"), rl.insert_stats.limited
            yield (name, "sample"), rl.sample_stats.limited

    def render(self) -> str:
        return self.registry.render()


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, status, ctype = self.server.render().encode(), 200, CONTENT_TYPE
            except Exception as exc:  # noqa: BLE001 (answer the scrape, keep serving)
                log.exception("rendering metrics failed")
                body, status, ctype = f"metrics failed: {exc}\n".encode(), 500, "text/plain"
        elif path == "/":
            body, status, ctype = b"gear-server: metrics at /metrics\n", 200, "text/plain"
        else:
            body, status, ctype = b"not found\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # scrapes are not events worth a log line
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], render: Callable[[], str]) -> None:
        self.render = render
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class MetricsServer:
    """The ``/metrics`` endpoint in a background thread; ``port`` is the bound port."""

    def __init__(self, render: Callable[[], str], bind: str = "0.0.0.0", port: int = 0) -> None:
        try:
            self._http = _HTTPServer((bind, port), render)
        except OSError as exc:
            raise OSError(exc.errno, f"metrics endpoint cannot listen on {bind}:{port}: {exc.strerror}") from exc
        self.port = self._http.server_address[1]
        self.bind = bind
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="gear-metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


class RpcObserver(grpc.ServerInterceptor):
    """Counts every finished RPC by method and status code (and hands errors to ``on_error``).

    Placed first among the server's interceptors so it also sees calls the
    token check refused.
    """

    def __init__(self, metrics: ServerMetrics | None,
                 on_error: Callable[[str, str], None] | None = None) -> None:
        self._metrics = metrics
        self._on_error = on_error
        # Wrapped handlers by the identity of the handler they wrap (one per method): built once.
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def _finish(self, method: str, context, unset: str) -> None:
        """Record the call's status code; ``unset`` names it when the servicer set none."""
        code = context.code() if hasattr(context, "code") else None
        name = unset if code is None else code.name
        if self._metrics is not None:
            self._metrics.rpc_finished(method, name)
        if name != "OK" and self._on_error is not None:
            self._on_error(method, name)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        entry = self._wrapped.get(id(handler))
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = self._wrap(handler, handler_call_details.method.rsplit("/", 1)[-1])
        if len(self._wrapped) > 4096:  # handlers made per call (not ours): keep the cache bounded
            self._wrapped.clear()
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        finish = self._finish

        if handler.response_streaming:
            inner = handler.stream_stream or handler.unary_stream

            def streaming(request, context):
                try:
                    yield from inner(request, context)
                except GeneratorExit:  # the client went away mid-stream
                    finish(method, context, "CANCELLED")
                    raise
                except BaseException:
                    finish(method, context, "UNKNOWN")
                    raise
                finish(method, context, "OK")

            make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                    else grpc.unary_stream_rpc_method_handler)
            behavior = streaming
        else:
            inner = handler.stream_unary or handler.unary_unary

            def unary(request, context):
                try:
                    response = inner(request, context)
                except BaseException:
                    finish(method, context, "UNKNOWN")
                    raise
                finish(method, context, "OK")
                return response

            make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                    else grpc.unary_unary_rpc_method_handler)
            behavior = unary
        return make(behavior, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
