"""Datasets take from a table only what they deliver, and deliver a batch as soon as one batch can be sampled.

Queues (max_times_sampled) and rate-limited tables (SampleToInsertRatio) are
selected one batch at a time, when the learner asks; tables whose sampling takes
nothing away are read ahead, several batches per Select. Each case runs over the
shm plane and over inline.
"""

from __future__ import annotations

import threading
import time

import pytest

import gear_client as reverb
from gear_client.data_planes.read_ahead import may_read_ahead, sampling_takes
from gear_client.data_planes.sampler import PlaneSampler, gathers_in_flight, select_width
from gear_contract._proto import replay_pb2 as pb
from tests.support.plane_daemon import queue_config, start_daemon, table_config
from tests.support.trajectories import check_batch, fill, insert

PLANES = [["shm"], ["inline"]]
ITEM = {"length": 4, "dim": 8}


def ratio_config(name: str) -> pb.TableConfig:
    """SampleToInsertRatio(2, 1, (0, 1000)): each insert allows two samples."""
    return table_config(name, 64, rate_limiter=pb.RateLimiterOptions(samples_per_insert=2.0, min_size_to_sample=1,
                                                                     min_diff=0.0, max_diff=1000.0))


@pytest.fixture
def daemon():
    d = start_daemon(queue_config("queue"), ratio_config("ratio"), table_config("uniform", 64))
    yield d
    d.stop()


def samples_taken(table) -> int:
    return int(table.info().rate_limiter_info.sample_stats.completed)


def next_within(ds, seconds: float):
    """The dataset's next batch, or None if none came within ``seconds`` (the wait goes on in the background)."""
    got: list = []
    thread = threading.Thread(target=lambda: got.append(next(ds.batches())), daemon=True)
    thread.start()
    thread.join(seconds)
    return (got[0] if got else None), thread


def test_the_table_semantics_decide_read_ahead(daemon):
    with PlaneSampler(daemon.address(), "queue") as s:
        assert not may_read_ahead(s.table_info()) and "after 1 sample" in sampling_takes(s.table_info())
    with PlaneSampler(daemon.address(), "ratio") as s:
        assert "rate limiter" in sampling_takes(s.table_info())
    with PlaneSampler(daemon.address(), "uniform") as s:
        assert may_read_ahead(s.table_info())
        with pytest.raises(KeyError, match="nope"):
            PlaneSampler(daemon.address(), "nope").table_info()


@pytest.mark.parametrize("planes", PLANES, ids=lambda p: p[0])
def test_a_queue_delivers_every_item_it_takes_and_takes_nothing_ahead(daemon, planes):
    table = daemon.tables["queue"]
    fill(table, 10, **ITEM)
    with reverb.TrajectoryDataset(daemon.address(), "queue", batch_size=4, planes=planes) as ds:
        start = time.monotonic()
        first, second = next(ds.batches()), next(ds.batches())
        assert time.monotonic() - start < 5 and ds.plane == planes[0] and ds.read_ahead is False
        assert check_batch(first) == 4 and check_batch(second) == 4
        assert first.keys.tolist() + second.keys.tolist() == list(range(1, 9))  # FIFO, each item once
        time.sleep(0.5)  # a dataset reading ahead would take the last two now
        assert table.size() == 2 and samples_taken(table) == 8
        third, waiting = next_within(ds, 0.5)  # two items left: a batch of four waits for more
        assert third is None
        fill(table, 2, start=11, **ITEM)
        waiting.join(5)
        assert not waiting.is_alive(), "the batch did not come once four items could be sampled"
    assert table.size() == 0 and samples_taken(table) == 12


@pytest.mark.parametrize("planes", PLANES, ids=lambda p: p[0])
def test_a_queue_of_eight_gives_two_batches_at_once(daemon, planes):
    table = daemon.tables["queue"]
    fill(table, 8, **ITEM)
    start = time.monotonic()
    with reverb.TrajectoryDataset(daemon.address(), "queue", batch_size=4, planes=planes,
                                  rate_limiter_timeout_ms=300) as ds:
        batches = list(ds.batches())
    assert [len(b) for b in batches] == [4, 4] and time.monotonic() - start < 5
    assert table.size() == 0 and samples_taken(table) == 8


@pytest.mark.parametrize("planes", PLANES, ids=lambda p: p[0])
def test_a_rate_limited_table_delivers_what_the_limiter_allows_and_ends_on_its_timeout(daemon, planes):
    table = daemon.tables["ratio"]
    fill(table, 8, **ITEM)  # allows 16 samples
    start = time.monotonic()
    with reverb.TrajectoryDataset(daemon.address(), "ratio", batch_size=4, planes=planes,
                                  rate_limiter_timeout_ms=300) as ds:
        batches = list(ds.batches())
    assert [len(b) for b in batches] == [4, 4, 4, 4] and time.monotonic() - start < 5
    assert samples_taken(table) == 16
    assert all(check_batch(b) == 4 for b in batches)


@pytest.mark.parametrize("planes", PLANES, ids=lambda p: p[0])
def test_a_rate_limited_table_gives_a_batch_as_soon_as_inserts_allow_one(daemon, planes):
    table = daemon.tables["ratio"]
    insert(table, 1, **ITEM)  # two samples allowed: half a batch
    with reverb.TrajectoryDataset(daemon.address(), "ratio", batch_size=4, planes=planes) as ds:
        batch, waiting = next_within(ds, 0.5)
        assert batch is None
        insert(table, 2, **ITEM)  # four allowed now
        waiting.join(5)
        assert not waiting.is_alive(), "no batch once the limiter allowed one"
        time.sleep(0.3)
        assert samples_taken(table) == 4  # nothing taken ahead of the learner
        more, waiting = next_within(ds, 0.3)
        assert more is None
        fill(table, 2, start=3, **ITEM)
        waiting.join(5)
        assert not waiting.is_alive()
    assert samples_taken(table) == 8


def test_uniform_tables_are_read_ahead_several_batches_per_select(daemon):
    table = daemon.tables["uniform"]
    fill(table, 16, **ITEM)
    assert select_width(4) == 8 and select_width(32) == 4 and select_width(256) == 1 and select_width(4, 3) == 3
    # into GPU memory: more batches per Select, bounded in bytes
    assert select_width(256, gpu=True) == 4 and select_width(32, gpu=True) == 8
    assert select_width(256, gpu=True, item_bytes=1 << 20) == 2 and select_width(4096, gpu=True) == 1
    assert gathers_in_flight(3, 1) == 3 and gathers_in_flight(3, 4) == 2 and gathers_in_flight(16, 4) == 4
    with PlaneSampler(daemon.address(), "uniform") as s:
        stream = s.batches(4)
        items = sum(check_batch(next(stream)) for _ in range(32))
        assert items == 128 and s.selects <= 8  # 32 batches from a handful of Selects
        stream.close()
    assert table.active_leases() == 0
    with reverb.TrajectoryDataset(daemon.address(), "uniform", batch_size=4, max_samples=40) as ds:
        sizes = [check_batch(b) for b in ds.batches()]
        assert ds.read_ahead is True
    assert sizes == [4] * 10
