"""Prometheus metrics: exposition, the HTTP endpoint, bounded labels, the RPC observer (gear_server.ops.metrics)."""

from __future__ import annotations

import re
import threading

import grpc
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server import __version__
from gear_server.ops.auth import AuthSettings
from gear_server.ops.logs import ErrorSummary
from gear_server.ops.metrics import (
    MAX_TABLE_LABELS,
    METHOD_LABELS,
    MetricsServer,
    MetricsSettings,
    ServerMetrics,
)
from gear_server.rpc.interceptors import RpcObserver
from tests.support.echo_server import call_method, start_server
from tests.support.metrics_text import parse, scrape, value


def label_names(text: str) -> dict[str, set[str]]:
    """Metric family -> the label names its samples use (le/quantile aside)."""
    out: dict[str, set[str]] = {}
    for (name, labels), _ in parse(text).items():
        family = re.sub(r"_(bucket|sum|count|total|created|info)$", "", name)
        out.setdefault(family, set()).update(k for k, _ in labels if k not in ("le", "quantile"))
    return out


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
    endpoint = MetricsServer(metrics.registry, bind="127.0.0.1", port=0)
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
    assert value(after, "gear_data_plane_sessions", plane="shm") == 1
    assert value(after, "gear_data_plane_sessions", plane="rdma") == 1
    assert value(after, "gear_data_plane_sessions_opened_total", plane="shm") == 2
    # Histogram buckets are cumulative: 0.2 ms falls in le=0.00025 and every bucket above.
    assert value(after, "gear_selection_latency_seconds_bucket", table="replay", le="0.0001") == 0
    assert value(after, "gear_selection_latency_seconds_bucket", table="replay", le="0.00025") == 1
    assert value(after, "gear_selection_latency_seconds_bucket", table="replay", le="+Inf") == 1
    assert value(after, "gear_selection_latency_seconds_count", table="replay") == 1
    assert value(after, "gear_transfer_latency_seconds_sum", table="replay", plane="inline") == pytest.approx(0.003)


def test_series_exist_at_zero_with_build_and_process_metrics_and_one_label_per_concept():
    table = FakeTable(0)
    metrics = ServerMetrics(tables=lambda: {"replay": table})
    text = metrics.render().decode()
    samples = parse(text)
    for plane in ("inline", "shm", "rdma"):
        assert ("gear_bytes_sent_total", frozenset({("table", "replay"), ("plane", plane)})) in samples
        assert ("gear_data_plane_sessions_opened_total", frozenset({("plane", plane)})) in samples
        assert ("gear_data_plane_sessions", frozenset({("plane", plane)})) in samples
    for name in ("gear_inserts_total", "gear_samples_total", "gear_bytes_received_total",
                 "gear_selection_latency_seconds_count"):
        assert (name, frozenset({("table", "replay")})) in samples, name
    for result in ("ok", "failed"):
        assert ("gear_checkpoints_total", frozenset({("result", result)})) in samples
    assert ("gear_rpcs_total", frozenset({("method", "Sample"), ("code", "OK")})) in samples
    assert value(samples, "process_resident_memory_bytes") > 0  # prometheus_client's process collector
    build = [labels for (name, labels) in samples if name == "gear_build_info"]
    assert len(build) == 1 and ("version", __version__) in build[0]
    # One label name per concept: the data plane is "plane" wherever it appears (no "kind").
    names = label_names(text)
    assert all("kind" not in labels for labels in names.values()), names
    assert {family for family, labels in names.items() if "plane" in labels} >= {
        "gear_bytes_sent", "gear_data_plane_sessions_opened", "gear_data_plane_sessions",
        "gear_transfer_latency_seconds"}
    # The HELP line says what OPERATIONS.md says: the rate limiter's wait is inside the selection time.
    help_line = next(line for line in text.splitlines() if line.startswith("# HELP gear_selection_latency_seconds"))
    assert "wait included" in help_line


def test_labels_stay_bounded_whatever_callers_send():
    metrics = ServerMetrics()
    baseline = len(metrics.render())
    for i in range(10_000):
        metrics.observe_rpc(f"/gear.v1.ReplayService/Made{i}", "UNIMPLEMENTED", 1e-4)
        metrics.auth_denied(f"/evil.Service/M{i}")
        metrics.observe_rpc(f"/x/{i}", f"CODE{i}")
    grown = len(metrics.render()) - baseline
    samples = parse(metrics.render().decode())
    assert value(samples, "gear_rpcs_total", method="unknown", code="UNIMPLEMENTED") == 10_000
    assert value(samples, "gear_rpcs_total", method="unknown", code="UNKNOWN") == 10_000
    assert value(samples, "gear_auth_denied_total", method="unknown") == 10_000
    assert grown < 4096, f"/metrics grew by {grown} bytes"  # a handful of new series, not 30,000
    # Served methods keep their names; more tables than MAX_TABLE_LABELS count under "other".
    assert {"Sample", "InsertStream", "Check", "ServerReflectionInfo"} <= set(METHOD_LABELS.values())
    metrics.observe_rpc("/gear.v1.ReplayService/Sample", grpc.StatusCode.OK)
    for i in range(MAX_TABLE_LABELS + 50):
        metrics.inserted(f"t{i}", 1, 1)
    samples = parse(metrics.render().decode())
    assert value(samples, "gear_rpcs_total", method="Sample", code="OK") == 1
    tables = {dict(labels)["table"] for (name, labels) in samples if name == "gear_inserts_total"}
    assert len(tables) == MAX_TABLE_LABELS + 1 and "other" in tables
    assert value(samples, "gear_inserts_total", table="other") == 50


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
    samples = parse(metrics.render().decode())
    assert value(samples, "gear_inserts_total", table="replay") == 20000
    assert value(samples, "gear_bytes_received_total", table="replay") == 200000


def test_rpc_observer_counts_codes_including_refused_calls():
    metrics = ServerMetrics()
    summary = ErrorSummary(interval_s=60)
    interceptors = [RpcObserver(metrics, on_error=summary.record),
                    *AuthSettings(token="t0k").interceptors(metrics.auth_denied)]
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
    samples = parse(metrics.render().decode())
    assert value(samples, "gear_rpcs_total", method="ServerInfo", code="UNAUTHENTICATED") == 1
    assert value(samples, "gear_rpcs_total", method="Sample", code="UNAUTHENTICATED") == 1
    assert value(samples, "gear_rpcs_total", method="ServerInfo", code="OK") == 1
    assert value(samples, "gear_rpcs_total", method="Sample", code="OK") == 1
    assert value(samples, "gear_rpcs_total", method="InsertStream", code="OK") == 1
    line = summary.flush()
    assert line is not None and "2 (" in line and "UNAUTHENTICATED x1" in line
    assert summary.flush() is None
    assert value(samples, "gear_auth_denied_total", method="Sample") == 1
    assert value(samples, "gear_rpc_duration_seconds_count", method="ServerInfo") == 2


def test_the_endpoint_listens_on_localhost_by_default():
    assert MetricsSettings().bind == "127.0.0.1"
    assert MetricsSettings.from_toml({}).bind == "127.0.0.1"


def test_settings():
    assert MetricsSettings.from_toml(None).enabled is False
    s = MetricsSettings.from_toml({"port": 0, "bind": "127.0.0.1"})
    assert s.enabled and s.port == 0
    with pytest.raises(ValueError, match="port"):
        MetricsSettings.from_toml({"port": 70000})
    with pytest.raises(ValueError, match="unknown key"):
        MetricsSettings.from_toml({"prot": 1})
