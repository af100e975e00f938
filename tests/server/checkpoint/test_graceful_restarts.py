"""Graceful restarts of a real daemon process lose and duplicate nothing.

Two writers (each waits for its flush) and one consumer (one item per
``client.sample``) run against a queue table while the daemon is sent SIGTERM
and started again from its final checkpoint, several times. Every key is
counted: each acknowledged item is delivered exactly once or is still in the
table at the end, and nothing is delivered twice.
"""

from __future__ import annotations

import collections
import signal
import threading
import time
import uuid

import numpy as np
import pytest

import gear_client
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_port

RESTARTS = 4
RUN_S = 2.5  # between restarts
TEST_DEADLINE_S = 480.0  # a bound for loaded machines; a quiet one takes about 40 s


def _config(tmp_path, port: int) -> str:
    return f'''
bind_address = "127.0.0.1"
port = {port}
instance_name = "restart{uuid.uuid4().hex[:8]}"

[[tables]]
name = "queue"
preset = "queue"
max_size = 100000

[checkpoint]
dir = "{tmp_path / 'checkpoints'}"
on_stop = true
restore = true
'''


class _Writer(threading.Thread):
    """Writes items whose one value is its id; an id counts as acknowledged once its flush returned."""

    def __init__(self, address: str, base: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.address, self.base, self.stop_event = address, base, stop
        self.acked: list[int] = []
        self.attempted: list[int] = []
        self.errors = 0

    def run(self) -> None:
        client = gear_client.Client(self.address, connect_timeout=60)
        n = 0
        while not self.stop_event.is_set():
            try:
                with client.trajectory_writer(1, reconnect_timeout_s=60) as writer:
                    while not self.stop_event.is_set():
                        value = self.base + n
                        n += 1
                        self.attempted.append(value)
                        writer.append({"v": np.array(value, np.int64)})
                        writer.create_item("queue", 1.0, {"v": writer.history["v"][-1]})
                        writer.flush()
                        self.acked.append(value)
            except Exception:  # noqa: BLE001 (the daemon went away mid-flush: that item is not acknowledged)
                self.errors += 1
                time.sleep(0.1)


class _Consumer(threading.Thread):
    """Takes one item at a time with client.sample and records every value it is handed."""

    def __init__(self, address: str, stop: threading.Event, data_planes):
        super().__init__(daemon=True)
        self.address, self.stop_event, self.data_planes = address, stop, data_planes
        self.delivered: list[int] = []
        self.errors = 0

    def run(self) -> None:
        client = gear_client.Client(self.address, connect_timeout=60, data_planes=self.data_planes)
        while not self.stop_event.is_set():
            try:
                for sample in client.sample("queue", num_samples=1, emit_timesteps=False):
                    self.delivered.append(int(np.asarray(sample.data[0]).reshape(-1)[0]))
            except Exception:  # noqa: BLE001 (the daemon stopped under the call; sample again)
                self.errors += 1
                time.sleep(0.05)


@pytest.mark.parametrize("data_planes", [None, ()], ids=["shm", "inline"])
def test_sigterm_restarts_lose_and_duplicate_no_acknowledged_item(tmp_path, data_planes):
    """``shm``: the consumer's samples are Selects over the shared-memory plane; ``inline``: Sample RPCs."""
    port = free_port()
    config = _config(tmp_path, port)
    started = time.monotonic()
    daemon = DaemonProcess(tmp_path, config, "run0")
    daemon.wait_ready()
    stop_writers, stop_consumer = threading.Event(), threading.Event()
    writers = [_Writer(daemon.address, base, stop_writers) for base in (1_000_000_000, 2_000_000_000)]
    consumer = _Consumer(daemon.address, stop_consumer, data_planes)
    logs = []
    try:
        for thread in (*writers, consumer):
            thread.start()
        for run in range(1, RESTARTS + 1):
            time.sleep(RUN_S)
            assert daemon.stop(signal.SIGTERM) == 0, daemon.log
            logs.append(daemon.log)
            daemon = DaemonProcess(tmp_path, config, f"run{run}")
            daemon.wait_ready()
            assert time.monotonic() - started < TEST_DEADLINE_S
        time.sleep(RUN_S)
        stop_writers.set()
        for writer in writers:
            writer.join(60)
            assert not writer.is_alive()
        # The consumer stops (its sample in progress returns: items are there, or the stop below ends it),
        # then one Sample call takes what is left: every key is counted, and the table ends empty.
        stop_consumer.set()
        consumer.join(30)
        client = gear_client.Client(daemon.address, data_planes=())
        remaining = client.server_info(timeout=30)["queue"].current_size
        left = [int(np.asarray(s.data[0]).reshape(-1)[0])
                for s in client.sample("queue", num_samples=remaining, emit_timesteps=False)] if remaining else []
        assert client.server_info(timeout=30)["queue"].current_size == 0
        client.close()
        assert daemon.stop(signal.SIGTERM) == 0, daemon.log  # ends a sample still waiting on the empty table
        consumer.join(60)
        assert not consumer.is_alive()
    finally:
        stop_writers.set()
        stop_consumer.set()
        daemon.stop()
    logs.append(daemon.log)
    seen = consumer.delivered + left
    acked = [v for w in writers for v in w.acked]
    attempted = {v for w in writers for v in w.attempted}
    assert len(acked) > 200, (len(acked), [w.errors for w in writers])
    duplicated = sorted(v for v, n in collections.Counter(seen).items() if n > 1)
    lost = sorted(set(acked) - set(seen))
    assert not duplicated, f"{len(duplicated)} item(s) delivered twice: {duplicated[:10]}"
    assert not lost, (f"{len(lost)} of {len(acked)} acknowledged item(s) never delivered: {lost[:10]}\n"
                      + "\n----\n".join(logs))
    assert set(seen) <= attempted  # nothing delivered that no writer wrote
    assert sum("checkpoint written" in log for log in logs) == RESTARTS + 1
