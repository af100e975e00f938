"""Tables whose samples are a limited budget, read by several datasets at once: every sample is delivered.

A prioritized table of ``max_times_sampled=10`` (priorities 0, 1 and 2) and a
queue are read by three Python datasets in three threads until the table is
spent: each item must be delivered exactly its budget, none sits taken in a
reader. The readers end on the rate limiter's timeout once the table is empty.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

import gear_client as reverb
from gear_client import datasets

READERS = 3
TIMEOUT_MS = 3000


def _read_all(address: str, table: str, batch_size: int) -> collections.Counter:
    got: collections.Counter = collections.Counter()
    lock = threading.Lock()
    failures = []

    def reader():
        try:
            with datasets.TrajectoryDataset(address, table, batch_size, rate_limiter_timeout_ms=TIMEOUT_MS) as ds:
                for sample in ds:
                    with lock:
                        got.update(int(k) for k in sample.info.key)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a reader never ended"
    assert not failures, failures
    return got


@pytest.mark.parametrize("batch_size", [1, 2])
def test_max_times_sampled_table_with_several_readers(batch_size):
    server = reverb.Server([reverb.Table("t", sampler=reverb.selectors.Prioritized(1.0),
                                         remover=reverb.selectors.Fifo(), max_size=3, max_times_sampled=10,
                                         rate_limiter=reverb.rate_limiters.MinSize(1))])
    try:
        client = reverb.Client(f"localhost:{server.port}")
        for priority in (0.0, 1.0, 2.0):
            client.insert(np.float32(priority), {"t": priority})
        got = _read_all(client.server_address, "t", batch_size)
        assert sorted(got.values()) == [10, 10, 10], got
        assert client.server_info()["t"].current_size == 0
    finally:
        server.stop()


def test_queue_with_several_readers():
    server = reverb.Server([reverb.Table.queue("q", 40)])
    try:
        client = reverb.Client(f"localhost:{server.port}")
        for i in range(40):
            client.insert(np.int64(i), {"q": 1.0})
        got = _read_all(client.server_address, "q", 1)
        assert len(got) == 40 and set(got.values()) == {1}, got
    finally:
        server.stop()
