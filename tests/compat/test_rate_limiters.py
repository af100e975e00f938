"""Rate limiters: validation, the values they configure, and blocking inserts/samples."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.compat import BLOCKED_MS, PROMPT_S, InThread, info_of, reverb, sample_one

rl = reverb.rate_limiters
MAX = sys.float_info.max


def _limits(limiter) -> tuple:
    """(spi, min_size, min_diff, max_diff) as a table configured with ``limiter`` reports them."""
    table = reverb.Table("t", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 10, limiter)
    info = table.info.rate_limiter_info
    return info.samples_per_insert, info.min_size_to_sample, info.min_diff, info.max_diff


@pytest.mark.parametrize("n", [0, -3])
def test_min_size_rejects_sizes_below_one(n):
    with pytest.raises(ValueError):
        rl.MinSize(n)


def test_min_size_limits():
    assert _limits(rl.MinSize(5)) == (1.0, 5, -MAX, MAX)


def test_queue_and_stack_limits():
    assert _limits(rl.Queue(7)) == (1.0, 1, 0.0, 7.0)
    assert _limits(rl.Stack(4)) == (1.0, 1, 0.0, 4.0)


def test_sample_to_insert_ratio_with_a_scalar_error_buffer():
    # offset = spi * min_size = 4; (min_diff, max_diff) = (4 - 3, 4 + 3)
    assert _limits(rl.SampleToInsertRatio(2.0, 2, 3.0)) == (2.0, 2, 1.0, 7.0)
    assert _limits(rl.SampleToInsertRatio(1.0, 10, 5)) == (1.0, 10, 5.0, 15.0)


def test_sample_to_insert_ratio_with_a_range_error_buffer():
    assert _limits(rl.SampleToInsertRatio(2.0, 3, (-4.0, 6.0))) == (2.0, 3, -4.0, 6.0)


@pytest.mark.parametrize("args", [
    (0.0, 1, 10.0),            # samples_per_insert <= 0
    (-1.0, 1, 10.0),
    (4.0, 1, 3.9),             # max_diff - min_diff = 7.8 < 2 * spi
    (1.0, 1, 0.9),             # 1.8 < 2 * max(1, spi)
    (1.0, 1, (-1.0, 0.5)),     # range 1.5 < 2
    (1.0, 2, (2.5, 10.0)),     # min_diff above spi * min_size
    (1.0, 0, 5.0),             # min_size < 1
])
def test_sample_to_insert_ratio_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        rl.SampleToInsertRatio(*args)


def test_rate_limiter_base_class_keeps_its_arguments():
    assert _limits(rl.RateLimiter(1.5, 2, -1.0, 3.0)) == (1.5, 2, -1.0, 3.0)


def _writer_insert(writer, table: str, value: int) -> None:
    writer.append({"x": np.int64(value)})
    writer.create_item(table, 1.0, {"x": writer.history["x"][-1]})


def test_worked_example_blocks_inserts_and_samples(client, table_by_name):
    """spi=1.5, min_size=2, min_diff=-1, max_diff=3.

    Sampling waits for two items. Two inserts leave diff = 2*1.5 = 3; a third would
    make 4.5 > 3 and blocks. One sample (diff 2) is not enough: the third would make
    3.5; a second sample (diff 1) lets it in (4.5 - 2 = 2.5 <= 3). This is what
    Reverb 0.14 does (checked with GEAR_COMPAT_BACKEND=reverb).
    """
    table = table_by_name["rate_limited"]
    sampler = InThread(lambda: sample_one(client, "rate_limited"))
    assert not sampler.done(BLOCKED_MS / 1000), "a sample went through before min_size_to_sample items"

    writer = client.trajectory_writer(1)
    try:
        _writer_insert(writer, "rate_limited", 0)
        writer.flush(timeout_ms=PROMPT_S * 1000)
        assert not sampler.done(BLOCKED_MS / 1000), "a sample went through with one item (min size 2)"
        assert not table.can_sample(1)
        _writer_insert(writer, "rate_limited", 1)
        writer.flush(timeout_ms=PROMPT_S * 1000)
        first = sampler.value()
        assert int(first.data[0]) == 0  # Fifo sampler
        assert table.can_insert(1) is False  # 3*1.5 - 1 = 3.5 > 3

        _writer_insert(writer, "rate_limited", 2)
        with pytest.raises(reverb.DeadlineExceededError):
            writer.flush(timeout_ms=BLOCKED_MS)
        info = info_of(client, "rate_limited")
        assert info.current_size == 2 and info.rate_limiter_info.insert_stats.completed == 2

        sample_one(client, "rate_limited")  # diff 1: the pending insert goes in
        writer.flush(timeout_ms=PROMPT_S * 1000)
        info = info_of(client, "rate_limited")
        assert info.current_size == 3
        assert info.rate_limiter_info.insert_stats.completed == 3
        assert info.rate_limiter_info.sample_stats.completed == 2
        # diff = 4.5 - 2 = 2.5: samples may go on down to min_diff -1 (3 more).
        assert table.can_sample(3) and not table.can_sample(4)
    finally:
        writer.close()


def test_blocked_sample_waits_until_an_insert_allows_it(client):
    sampler = InThread(lambda: sample_one(client, "min_size_2"))
    client.insert(np.int64(0), {"min_size_2": 1.0})
    assert not sampler.done(BLOCKED_MS / 1000)
    client.insert(np.int64(1), {"min_size_2": 1.0})
    assert int(sampler.value().data[0][0]) == 0


def test_every_removal_counts_as_a_delete(client, table_by_name):
    table = table_by_name["sampled_once_min2"]
    for i in range(2):
        client.insert(np.int64(i), {"sampled_once_min2": 1.0})
    assert table.can_sample(1)
    sample_one(client, "sampled_once_min2")  # max_times_sampled=1 removes it
    assert info_of(client, "sampled_once_min2").current_size == 1
    assert not table.can_sample(1)  # inserts - deletes = 1 < min size 2

    other = table_by_name["min_size_2"]
    for i in range(2):
        client.insert(np.int64(i), {"min_size_2": 1.0})
    assert other.can_sample(1)
    key = sample_one(client, "min_size_2").info.key
    client.mutate_priorities("min_size_2", deletes=[key])
    assert not other.can_sample(1)


def test_priority_updates_are_not_inserts(client, table_by_name):
    table = table_by_name["rate_limited"]
    client.insert(np.int64(0), {"rate_limited": 1.0})
    client.insert(np.int64(1), {"rate_limited": 1.0})
    key = sample_one(client, "rate_limited").info.key
    for p in (2.0, 3.0, 4.0):
        client.mutate_priorities("rate_limited", updates={key: p})
    info = info_of(client, "rate_limited")
    assert info.rate_limiter_info.insert_stats.completed == 2
    assert not table.can_insert(1)  # still 3.5 > 3, as before the updates
