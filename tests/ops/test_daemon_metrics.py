"""The Prometheus endpoint of a real daemon process: counters move with the traffic."""

from __future__ import annotations

import uuid

import pytest

import gear_client

from ._support import DaemonProcess, drain_queue, free_port, insert_items, tables_toml
from .test_metrics import scrape, value


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
    assert value(after, "gear_data_plane_sessions_opened_total", kind="shm") == 1
    assert value(after, "gear_data_plane_sessions", kind="shm") == 1
    assert value(after, "gear_bytes_sent_total", table="prio", plane="shm") == 4 * 16
    assert value(after, "gear_rpcs_total", method="InsertStream", code="OK") >= 5
    assert value(after, "gear_rpcs_total", method="Sample", code="NOT_FOUND") == 1
    assert value(after, "gear_rate_limiter_wait_seconds_total", table="prio", op="insert") >= 0
    assert ("gear_rate_limiter_wait_seconds_total", frozenset({("table", "prio"), ("op", "sample")})) in after
