"""Prometheus metrics: exposition format, the HTTP endpoint, the RPC observer (gear_server.metrics)."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.auth import AuthSettings
from gear_server.logs import ErrorSummary
from gear_server.metrics import CONTENT_TYPE, MetricsServer, MetricsSettings, Registry, RpcObserver, ServerMetrics

from ._support import call_method, start_server

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Text exposition -> {(name, labels): value}; fails on a malformed line."""
    out = {}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, f"malformed exposition line: {line!r}"
        name, _, labels, value = match.groups()
        pairs = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        out[(name, pairs)] = float(value)
    assert types, "no # TYPE lines"
    return out


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE
        return parse(response.read().decode())


def value(samples, metric, **labels) -> float:
    return samples.get((metric, frozenset(labels.items())), 0.0)


class FakeTable:
    """What ServerMetrics reads from a table at scrape time: info()."""

    def __init__(self, size: int):
        self.size = size

    def info(self) -> pb.TableInfo:
        info = pb.TableInfo(name="replay", current_size=self.size, max_size=100)
        info.rate_limiter_info.insert_stats.completed_wait_time_s = 1.5
        info.rate_limiter_info.sample_stats.pending_wait_time_s = 0.25
        info.rate_limiter_info.sample_stats.limited = 3
        return info


def test_counters_histograms_and_callbacks_move_on_the_endpoint():
    table = FakeTable(5)
    metrics = ServerMetrics(tables=lambda: {"replay": table})
    endpoint = MetricsServer(metrics.render, bind="127.0.0.1", port=0)
    try:
        before = scrape(endpoint.port)
        assert value(before, "gear_table_size", table="replay") == 5
        assert value(before, "gear_inserts_total", table="replay") == 0
        metrics.inserted("replay", 3, 300)
        metrics.sampled("replay", 2, 200, "inline")
        metrics.sampled("replay", 4, 0, "shm")
        metrics.observe_selection("replay", 0.0002)
        metrics.observe_transfer("replay", "inline", 0.003)
        sessions = {"shm": 2, "rdma": 1}
        metrics.watch_sessions(lambda: sessions)
        metrics.plane_opened("shm")
        metrics.plane_opened("shm")
        sessions["shm"] = 1
        table.size = 8
        after = scrape(endpoint.port)
    finally:
        endpoint.close()
    assert value(after, "gear_inserts_total", table="replay") == 3
    assert value(after, "gear_bytes_received_total", table="replay") == 300
    assert value(after, "gear_samples_total", table="replay") == 6
    assert value(after, "gear_bytes_sent_total", table="replay", plane="inline") == 200
    assert value(after, "gear_table_size", table="replay") == 8
    assert value(after, "gear_rate_limiter_wait_seconds_total", table="replay", op="insert") == 1.5
    assert value(after, "gear_rate_limiter_wait_seconds_total", table="replay", op="sample") == 0.25
    assert value(after, "gear_rate_limiter_limited_total", table="replay", op="sample") == 3
    assert value(after, "gear_data_plane_sessions", kind="shm") == 1
    assert value(after, "gear_data_plane_sessions", kind="rdma") == 1
    assert value(after, "gear_data_plane_sessions_opened_total", kind="shm") == 2
    # Histogram buckets are cumulative: 0.2 ms falls in le=0.00025 and every bucket above.
    assert value(after, "gear_selection_latency_seconds_bucket", table="replay", le="0.0001") == 0
    assert value(after, "gear_selection_latency_seconds_bucket", table="replay", le="0.00025") == 1
    assert value(after, "gear_selection_latency_seconds_bucket", table="replay", le="+Inf") == 1
    assert value(after, "gear_selection_latency_seconds_count", table="replay") == 1
    assert value(after, "gear_transfer_latency_seconds_sum", table="replay", plane="inline") == pytest.approx(0.003)


def test_label_values_are_escaped_and_unknown_paths_are_404():
    registry = Registry()
    registry.counter("x_total", "help", ["name"]).labels('a"b\\c\nd').inc(2)
    text = registry.render()
    assert 'x_total{name="a\\"b\\\\c\\nd"} 2' in text
    assert value(parse(text), "x_total", name='a\\"b\\\\c\\nd') == 2
    with pytest.raises(ValueError, match="registered twice"):
        registry.counter("x_total", "again")
    endpoint = MetricsServer(registry.render, bind="127.0.0.1", port=0)
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/nothing", timeout=10)
        assert info.value.code == 404
    finally:
        endpoint.close()


def test_counters_are_exact_under_concurrent_updates():
    metrics = ServerMetrics()

    def work():
        for _ in range(5000):
            metrics.inserted("replay", 1, 10)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = parse(metrics.render())
    assert value(samples, "gear_inserts_total", table="replay") == 20000
    assert value(samples, "gear_bytes_received_total", table="replay") == 200000


def test_rpc_observer_counts_codes_including_refused_calls():
    metrics = ServerMetrics()
    summary = ErrorSummary(interval_s=60)
    interceptors = [RpcObserver(metrics, on_error=summary.record), *AuthSettings(token="t0k").interceptors()]
    server, port = start_server(interceptors)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert call_method(channel, "ServerInfo") == grpc.StatusCode.UNAUTHENTICATED
            assert call_method(channel, "Sample") == grpc.StatusCode.UNAUTHENTICATED
            auth = [("authorization", "Bearer t0k")]
            assert call_method(channel, "ServerInfo", metadata=auth) == grpc.StatusCode.OK
            assert call_method(channel, "Sample", metadata=auth) == grpc.StatusCode.OK
            assert call_method(channel, "InsertStream", metadata=auth) == grpc.StatusCode.OK
    finally:
        server.stop(None)
    samples = parse(metrics.render())
    assert value(samples, "gear_rpcs_total", method="ServerInfo", code="UNAUTHENTICATED") == 1
    assert value(samples, "gear_rpcs_total", method="Sample", code="UNAUTHENTICATED") == 1
    assert value(samples, "gear_rpcs_total", method="ServerInfo", code="OK") == 1
    assert value(samples, "gear_rpcs_total", method="Sample", code="OK") == 1
    assert value(samples, "gear_rpcs_total", method="InsertStream", code="OK") == 1
    line = summary.flush()
    assert line is not None and "2 (" in line and "UNAUTHENTICATED x1" in line
    assert summary.flush() is None


def test_settings():
    assert MetricsSettings.from_toml(None).enabled is False
    s = MetricsSettings.from_toml({"port": 0, "bind": "127.0.0.1"})
    assert s.enabled and s.port == 0
    with pytest.raises(ValueError, match="port"):
        MetricsSettings.from_toml({"port": 70000})
    with pytest.raises(ValueError, match="unknown key"):
        MetricsSettings.from_toml({"prot": 1})
