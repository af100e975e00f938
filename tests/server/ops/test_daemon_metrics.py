"""The Prometheus endpoint of a real daemon process: counters move with the traffic, labels stay bounded."""

from __future__ import annotations

import urllib.request
import uuid

import grpc
import pytest

import gear_client
from tests.support.daemon_process import DaemonProcess
from tests.support.metrics_text import parse, scrape, value
from tests.support.ports import free_port
from tests.support.tables_toml import drain_queue, insert_items, tables_toml


def test_scrape_shows_inserts_samples_bytes_sizes_latencies_and_errors(tmp_path):
    port = free_port()
    config = tables_toml(f"ops{uuid.uuid4().hex[:8]}") + f'\n[metrics]\nbind = "127.0.0.1"\nport = {port}\n'
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.wait_ready()
        before = scrape(port)
        assert value(before, "gear_table_size", table="prio") == 0
        assert value(before, "gear_inserts_total", table="prio") == 0

        inline = gear_client.Client(daemon.address, data_planes=())
        insert_items(inline, range(5))
        assert drain_queue(inline, 2) == [0, 1]
        with pytest.raises(RuntimeError):
            next(iter(inline.sample("no_such_table", 1)))
        shm = gear_client.Client(daemon.address)  # negotiates the shared-memory plane on this host
        assert len(list(shm.sample("prio", num_samples=4, emit_timesteps=False))) == 4
        after = scrape(port)
    finally:
        assert daemon.stop() == 0

    for table in ("queue", "prio"):
        assert value(after, "gear_inserts_total", table=table) == 5
        assert value(after, "gear_bytes_received_total", table=table) == 5 * 4 * 4  # five float32[4]
    assert value(after, "gear_table_size", table="prio") == 5
    assert value(after, "gear_table_size", table="queue") == 3  # a queue drops what it handed out
    assert value(after, "gear_samples_total", table="queue") == 2
    assert value(after, "gear_bytes_sent_total", table="queue", plane="inline") > 2 * 16
    assert value(after, "gear_transfer_latency_seconds_count", table="queue", plane="inline") >= 1
    assert value(after, "gear_selection_latency_seconds_count", table="queue") >= 1
    assert value(after, "gear_selection_latency_seconds_count", table="prio") >= 1
    assert value(after, "gear_samples_total", table="prio") == 4
    # The second client is on the daemon's host: it read 'prio' through shared memory.
    assert value(after, "gear_data_plane_sessions_opened_total", plane="shm") == 1
    assert value(after, "gear_data_plane_sessions", plane="shm") == 1
    assert value(after, "gear_bytes_sent_total", table="prio", plane="shm") == 4 * 16
    assert value(after, "gear_rpcs_total", method="InsertStream", code="OK") >= 5
    assert value(after, "gear_rpcs_total", method="Sample", code="NOT_FOUND") == 1
    assert value(after, "gear_rate_limiter_wait_seconds_total", table="prio", op="insert") >= 0
    assert ("gear_rate_limiter_wait_seconds_total", frozenset({("table", "prio"), ("op", "sample")})) in after


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _scrape_bytes(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read()


def _call_made_up_methods(address: str, start: int, count: int) -> None:
    """``count`` calls without the token to methods the daemon does not serve; each must be refused."""
    with grpc.insecure_channel(address) as channel:
        for first in range(start, start + count, 200):
            calls = [channel.unary_unary(f"/gear.v1.ReplayService/MadeUp{i}")
                     .future(b"", timeout=30) for i in range(first, min(first + 200, start + count))]
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call.result()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_made_up_methods_without_the_token_grow_neither_metrics_nor_memory_nor_the_log(tmp_path):
    """10,000 refused calls to made-up methods: one ``unknown`` series, flat RSS, a short summary line."""
    port = free_port()
    config = tables_toml(f"ops{uuid.uuid4().hex[:8]}") + f'''
[metrics]
bind = "127.0.0.1"
port = {port}

[auth]
token = "only-for-this-test"

[logging]
client_error_summary_s = 1
'''
    daemon = DaemonProcess(tmp_path, config)
    try:
        daemon.wait_ready()
        # Warm up gRPC's pools and arenas and fill the token check's bounded cache (4,096 refusals):
        # the same 5,000 calls to one method name grow RSS about as much as to 5,000 names.
        _call_made_up_methods(daemon.address, 0, 5000)
        before_text, before_rss = _scrape_bytes(port), _rss_bytes(daemon.process.pid)
        _call_made_up_methods(daemon.address, 5000, 10_000)
        after_text, after_rss = _scrape_bytes(port), _rss_bytes(daemon.process.pid)
    finally:
        assert daemon.stop() == 0
    after = parse(after_text.decode())
    assert value(after, "gear_auth_denied_total", method="unknown") == 15_000
    assert value(after, "gear_rpcs_total", method="unknown", code="UNAUTHENTICATED") == 15_000
    assert len(after_text.splitlines()) == len(before_text.splitlines())  # no new series
    assert len(after_text) - len(before_text) < 2048
    assert after_rss - before_rss < 6 << 20, f"RSS grew by {(after_rss - before_rss) / 2**20:.1f} MiB"
    summaries = [line for line in daemon.log.splitlines() if "failed calls in the last" in line]
    assert summaries and "UNAUTHENTICATED" in summaries[-1]
    assert max(len(line) for line in summaries) < 4096
