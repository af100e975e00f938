"""Rate limiter: Reverb's formulas, blocking with timeouts, stats, reset, cancel."""

from __future__ import annotations

import threading
import time

import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import RateLimiterTimeout, TableClosedError
from gear_server.table.rate_limiter import RateLimiter, deadline_after
from tests.support.tables import MAX_FLOAT, MIN_FLOAT, item, make_table


def limiter(spi=1.0, min_size=1, min_diff=MIN_FLOAT, max_diff=MAX_FLOAT) -> RateLimiter:
    opts = pb.RateLimiterOptions(samples_per_insert=spi, min_size_to_sample=min_size, min_diff=min_diff,
                                 max_diff=max_diff)
    return RateLimiter(opts, threading.Lock())


def test_can_sample_formula():
    rl = limiter(spi=2.0, min_size=3, min_diff=-1.0, max_diff=10.0)
    rl.inserts = 2
    assert not rl.can_sample(1)  # inserts - deletes < min_size
    rl.inserts = 3
    # 3 * 2 - 0 - n >= -1  <=>  n <= 7
    assert rl.can_sample(7) and not rl.can_sample(8)
    rl.samples = 5
    assert rl.can_sample(2) and not rl.can_sample(3)
    rl.deletes = 1  # size 2 < 3
    assert not rl.can_sample(1)


def test_can_insert_formula():
    rl = limiter(spi=2.0, min_size=3, min_diff=-1.0, max_diff=4.0)
    # below min size inserts are free: inserts + n - deletes <= min_size
    assert rl.can_insert(3)
    # 4 inserts -> past min size: (0 + 4) * 2 - 0 = 8 > 4
    assert not rl.can_insert(4)
    rl.inserts, rl.deletes = 5, 3  # 5 + 1 - 3 = 3 <= 3: free
    assert rl.can_insert(1)
    rl.deletes = 0
    rl.samples = 9  # (5 + 1) * 2 - 9 = 3 <= 4
    assert rl.can_insert(1) and not rl.can_insert(2)


def test_samples_allowed_now_matches_can_sample():
    rl = limiter(spi=1.5, min_size=2, min_diff=-1.0, max_diff=3.0)
    for inserts in range(0, 6):
        for samples in range(0, 9):
            rl.inserts, rl.samples = inserts, samples
            m = rl.samples_allowed_now(100)
            if m:
                assert rl.can_sample(m) and (m == 100 or not rl.can_sample(m + 1))
            else:
                assert not rl.can_sample(1)


def test_worked_example_from_reverb_docs(store):
    """spi=1.5, min_size=2, min_diff=-1, max_diff=3 (REVERB_COMPAT.md's example).

    Two inserts are free (below min size) and leave diff 2 * 1.5 = 3. A third insert
    needs (2 + 1) * 1.5 - samples <= 3: with no sample that is 4.5 and it blocks; one
    sample makes it 3.5, still blocked; a second sample makes it 2.5 and it goes in.
    (The compat page's prose has the arithmetic slightly off; these are Reverb's
    formulas, which REVERB_COMPAT.md states and reverb/cc/rate_limiter.cc implements.)
    """
    rl_opts = pb.RateLimiterOptions(samples_per_insert=1.5, min_size_to_sample=2, min_diff=-1.0, max_diff=3.0)
    table = make_table(store, rate_limiter=rl_opts)
    table.insert(item(1))
    table.insert(item(2))
    counts = table.rate_limiter_counts()
    assert counts.inserts * rl_opts.samples_per_insert - counts.samples == 3.0
    assert not table.can_insert(1)
    assert table.can_sample(1)
    with pytest.raises(RateLimiterTimeout):
        table.insert(item(3), timeout=0.05)
    assert len(table) == 2

    done = threading.Event()
    errors = []

    def third():
        try:
            table.insert(item(3), timeout=10)
            done.set()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.1)
    assert not done.is_set()  # blocked by the limiter
    table.release(table.sample(1, timeout=5).lease_id)
    time.sleep(0.1)
    assert not done.is_set()  # 3.5 > 3: still blocked
    table.release(table.sample(1, timeout=5).lease_id)
    assert done.wait(5)
    t.join(5)
    assert not errors
    assert len(table) == 3
    info = table.info().rate_limiter_info
    assert info.insert_stats.completed == 3  # Reverb 0.14: the insert counter (the timed-out call inserted nothing)
    assert info.insert_stats.limited == 2  # gear's addition: calls that waited (the timed-out one included)
    assert info.insert_stats.completed_wait_time_s > 0.05
    table.close()


def test_sample_blocks_until_insert_and_times_out(store):
    table = make_table(store, rate_limiter=pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=2,
                                                                 min_diff=MIN_FLOAT, max_diff=MAX_FLOAT))
    table.insert(item(1))
    t0 = time.monotonic()
    with pytest.raises(RateLimiterTimeout):
        table.sample(1, timeout=0.1)
    assert time.monotonic() - t0 >= 0.09
    result = {}

    def sampler():
        result["sel"] = table.sample(2, timeout=10)

    t = threading.Thread(target=sampler)
    t.start()
    time.sleep(0.05)
    assert "sel" not in result
    assert table.info().rate_limiter_info.sample_stats.pending_wait_time_s > 0
    table.insert(item(2))
    t.join(5)
    assert len(result["sel"]) == 2
    stats = table.info().rate_limiter_info.sample_stats
    assert stats.completed == 2  # the samples taken (Reverb 0.14 reports the counter)
    assert stats.limited == 2  # the timed-out call and the batch that waited
    table.close()


def test_sample_batch_blocks_between_items_per_sample_limit(store):
    """A batch of 4 under a 1:1 ratio with min_diff 0 takes what the inserts allow, waiting between."""
    rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=100.0)
    table = make_table(store, rate_limiter=rl)
    table.insert(item(1))
    table.insert(item(2))
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("sel", table.sample(4, timeout=10)))
    t.start()
    time.sleep(0.1)
    assert "sel" not in got  # two samples taken, waiting for more inserts
    table.insert(item(3))
    table.insert(item(4))
    t.join(5)
    assert len(got["sel"]) == 4
    assert table.rate_limiter_counts().samples == 4
    table.close()


def test_partial_batch_returned_when_timeout_passes_after_some_samples(store):
    rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=100.0)
    table = make_table(store, rate_limiter=rl)
    table.insert(item(1))
    table.insert(item(2))
    sel = table.sample(5, timeout=0.05)
    assert len(sel) == 2
    table.release(sel.lease_id)
    with pytest.raises(RateLimiterTimeout):
        table.sample(1, timeout=0.0)
    table.close()


def test_priority_updates_are_not_inserts(store):
    table = make_table(store)
    table.insert(item(1))
    table.insert(item(1, priority=5.0))  # existing key: update
    table.mutate_priorities({1: 3.0})
    counts = table.rate_limiter_counts()
    assert (counts.inserts, counts.deletes) == (1, 0)
    assert table.info().rate_limiter_info.insert_stats.completed == 1
    table.close()


def test_every_removal_counts_as_delete(store):
    table = make_table(store, max_size=3, max_times_sampled=2, sampler="fifo")
    for k in range(4):  # the 4th insert evicts one (remover)
        table.insert(item(k))
    assert table.info().rate_limiter_info.num_deletes == 1
    table.mutate_priorities(deletes=[2])  # explicit delete
    assert table.info().rate_limiter_info.num_deletes == 2
    sel = table.sample(2)  # fifo: same item twice -> reaches max_times_sampled -> deleted
    table.release(sel.lease_id)
    assert table.info().rate_limiter_info.num_deletes == 3
    assert len(table) == 1
    table.close()


def test_reset_zeroes_counters_and_unblocks(store):
    rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=2.0)
    table = make_table(store, rate_limiter=rl)
    table.insert(item(1))
    table.insert(item(2))
    assert not table.can_insert(1)
    done = threading.Event()
    t = threading.Thread(target=lambda: (table.insert(item(3), timeout=10), done.set()))
    t.start()
    time.sleep(0.05)
    assert not done.is_set()
    table.reset()
    assert done.wait(5)
    t.join(5)
    counts = table.rate_limiter_counts()
    assert (counts.inserts, counts.samples, counts.deletes) == (1, 0, 0)
    assert len(table) == 1
    table.close()


def test_close_wakes_blocked_insert_and_sample(store):
    empty = make_table(store, name="empty")  # sampling waits for a first item
    full = make_table(store, name="full", rate_limiter=pb.RateLimiterOptions(
        samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=1.0))
    full.insert(item(1))  # a second insert waits for a sample
    errors = []

    def call(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=call, args=(lambda: empty.sample(1, timeout=30),)),
               threading.Thread(target=call, args=(lambda: full.insert(item(9), timeout=30),))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert not errors
    empty.close()
    full.close()
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    assert len(errors) == 2 and all(isinstance(e, TableClosedError) for e in errors)
    with pytest.raises(TableClosedError):
        full.insert(item(10))
    with pytest.raises(TableClosedError):
        empty.sample(1, timeout=0)


def test_deadline_after():
    assert deadline_after(None) is None
    assert deadline_after(-1) <= time.monotonic()


# ------------------------------------------------------------------ event-loop callers (TableCalls)

def _run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def test_event_loop_waits_hold_no_thread_and_keep_reverbs_stats(store):
    """Calls from an event loop wait on the limiter without a thread; stats count each call once."""
    import asyncio

    from gear_server.rpc.table_calls import TableCalls

    rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=100.0)
    table = make_table(store, rate_limiter=rl)
    calls = TableCalls(2)  # fewer threads than waiting calls: waits must not hold them

    async def scenario():
        samplers = [asyncio.ensure_future(calls.sample(table, 2, timeout=10)) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert not any(s.done() for s in samplers)
        assert table.info().rate_limiter_info.sample_stats.pending_wait_time_s > 0
        for key in range(1, 11):  # each insert allows one sample: 10 for 5 batches of 2
            await calls.insert(table, item(key), timeout=10)
        selections = await asyncio.wait_for(asyncio.gather(*samplers), 10)
        keys = sorted(int(k) for s in selections for k in s.keys)
        for s in selections:
            for lease in s.lease_ids:
                table.release(lease)
        return keys

    keys = _run(scenario())
    assert len(keys) == 10
    stats = table.info().rate_limiter_info.sample_stats
    assert stats.completed == 10 and stats.pending_wait_time_s == 0
    assert 5 <= stats.limited <= 10  # each batch waited (a batch waits again between its two items)
    assert table.active_leases() == 0
    calls.shutdown()
    table.close()


def test_event_loop_timeout_cancel_and_partial_batch(store):
    import asyncio

    from gear_server.rpc.table_calls import TableCalls

    rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=100.0)
    table = make_table(store, rate_limiter=rl)
    calls = TableCalls(2)

    async def scenario():
        started = time.monotonic()
        with pytest.raises(RateLimiterTimeout):
            await calls.sample(table, 1, timeout=0.1)  # nothing allowed: DEADLINE_EXCEEDED
        assert time.monotonic() - started >= 0.09
        waiting = asyncio.ensure_future(calls.sample(table, 1, timeout=None))
        await asyncio.sleep(0.05)
        waiting.cancel()  # its RPC ended: it takes nothing and is not counted
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await calls.insert(table, item(1), timeout=1)
        await calls.insert(table, item(2), timeout=1)
        partial = await calls.sample(table, 3, timeout=0.2)  # two allowed, the third times out: two returned
        assert len(partial) == 2
        for lease in partial.lease_ids:
            table.release(lease)

    _run(scenario())
    stats = table.info().rate_limiter_info.sample_stats
    assert stats.completed == 2
    assert stats.limited == 2  # the timed-out call and the partial batch's wait; not the cancelled one
    assert stats.pending_wait_time_s == 0 and table.active_leases() == 0
    calls.shutdown()
    table.close()


def test_a_woken_waiter_that_leaves_passes_the_wake_on(store):
    """The limiter wakes as many waiters as it allows; one that left meanwhile hands its wake to the next."""
    from gear_server.table.rate_limiter import WaitTicket, WouldBlock

    rl = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=100.0)
    table = make_table(store, rate_limiter=rl)
    woken: list[str] = []
    first, second = WaitTicket(lambda: woken.append("first")), WaitTicket(lambda: woken.append("second"))
    for ticket in (first, second):
        with ticket.attempting(), pytest.raises(WouldBlock):
            table.sample(1, timeout=0)
    table.insert(item(1))  # one sample allowed: only the oldest waiter is woken
    assert woken == ["first"]
    first.abandon()  # it left without attempting: the wake goes on
    assert woken == ["first", "second"]
    with second.attempting():
        selection = table.sample(1, timeout=0)
    second.settle()
    table.release(selection.lease_id)
    stats = table.info().rate_limiter_info.sample_stats
    assert stats.completed == 1 and stats.limited == 1 and stats.pending_wait_time_s == 0
    table.close()
