"""CommitLane: one pool job per table at a time, messages batched, each message's error its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.ingest.commit_lane import CommitLane
from gear_server.rpc.table_calls import TableCalls
from tests.support.tables import MIN_FLOAT, item, make_table


class Counting:
    """A real table whose inserts count how many run at once (the lane must never run two)."""

    def __init__(self, table):
        self.table = table
        self.name = table.name
        self.active = 0
        self.most = 0
        self._lock = threading.Lock()

    def insert(self, it, timeout=None, abandoned=None):
        with self._lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            self.table.insert(it, timeout=timeout, abandoned=abandoned)
        finally:
            with self._lock:
                self.active -= 1


def test_concurrent_messages_batched_in_order_one_job_at_a_time(store):  # noqa: F811
    table = make_table(store, max_size=1000)
    counting = Counting(table)
    calls = TableCalls(8)
    acked: list[int] = []

    async def main():
        lane = CommitLane(calls)
        await asyncio.gather(*(lane.commit([(counting, item(10 * m + i)) for i in range(3)],
                                           lambda _, it: acked.append(it.key)) for m in range(40)))
        return lane

    try:
        lane = asyncio.run(main())
    finally:
        calls.shutdown()
    assert table.info().current_size == 120
    assert counting.most == 1
    assert lane.jobs < 40  # messages that arrived together went in one job
    assert acked == sorted(acked)  # arrival order, each message's items in order
    table.close()


def test_a_message_error_ends_only_that_message(store):  # noqa: F811
    table = make_table(store, max_size=1000)
    calls = TableCalls(2)

    async def main():
        lane = CommitLane(calls)
        bad = item(2)
        bad.columns = bad.columns[:1]  # one column short: ValueError
        results = await asyncio.gather(
            lane.commit([(table, item(1))]),
            lane.commit([(table, item(3)), (table, bad), (table, item(4))]),
            lane.commit([(table, item(5))]),
            return_exceptions=True)
        return results

    try:
        results = asyncio.run(main())
    finally:
        calls.shutdown()
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], ValueError)
    meta = table.meta
    assert set(meta.key[meta.valid].tolist()) == {1, 3, 5}  # 3 went in before the bad item; 4 did not
    table.close()


def test_rate_limiter_holds_the_lane_and_callers_that_leave_are_skipped(store):  # noqa: F811
    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=MIN_FLOAT, max_diff=2.0)
    table = make_table(store, max_size=1000, rate_limiter=limiter)
    calls = TableCalls(2)

    async def main():
        lane = CommitLane(calls)
        await lane.commit([(table, item(1)), (table, item(2))])  # then inserts - samples = 2 = max_diff
        waiting = asyncio.ensure_future(lane.commit([(table, item(3))]))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # held by the limiter
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.05)
        later = asyncio.ensure_future(lane.commit([(table, item(4))]))
        await asyncio.sleep(0.1)
        assert not later.done()
        selection = await calls.sample(table, 1, None)  # a sample makes room for one insert
        await calls.run(table.release, selection.lease_id)
        await asyncio.wait_for(later, 5)

    try:
        asyncio.run(main())
    finally:
        calls.shutdown()
    assert table.info().current_size == 3  # 1, 2, 4: the caller of 3 left before its turn
    table.close()
