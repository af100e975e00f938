"""``Table.stop_sampling``: the first step of a graceful stop takes nothing from a table and hands over what was taken.

Blocked samplers (threads and event-loop calls) end with SamplingStopped (UNAVAILABLE) having taken
nothing; inserts go on; the items stay for the final checkpoint.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from gear_server.errors import SamplingStopped
from gear_server.rpc.statuses import status_of
from gear_server.rpc.table_calls import TableCalls
from tests.support.tables import item, make_table


def test_a_blocked_sample_ends_taking_nothing_and_inserts_go_on(store):
    table = make_table(store, max_times_sampled=1)
    ended: list[BaseException] = []

    def sample() -> None:
        try:
            table.sample(1, timeout=30)
        except BaseException as e:  # noqa: BLE001
            ended.append(e)

    waiter = threading.Thread(target=sample)
    waiter.start()
    waiter.join(0.3)  # it waits on the empty table (were it not yet waiting, it would end the same way)
    table.stop_sampling()
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(ended) == 1 and isinstance(ended[0], SamplingStopped)
    assert status_of(ended[0])[0].name == "UNAVAILABLE"
    table.insert(item(1), timeout=5)
    with pytest.raises(SamplingStopped):
        table.sample(1, timeout=0)
    assert table.size() == 1  # nothing taken: the final checkpoint holds it
    table.close()


def test_event_loop_samples_end_and_a_partial_pick_is_handed_over(store):
    table = make_table(store, max_times_sampled=1)
    for key in (1, 2):
        table.insert(item(key), timeout=5)
    calls = TableCalls(4)

    async def run():
        # Three asked, two there: the call takes them and waits for a third.
        partial = asyncio.ensure_future(calls.sample(table, 3, timeout=30))
        await asyncio.sleep(0.3)
        waiting = asyncio.ensure_future(calls.sample(table, 1, timeout=30))  # finds nothing: waits
        await asyncio.sleep(0.2)
        assert not partial.done() and not waiting.done()
        table.stop_sampling()
        taken = await asyncio.wait_for(partial, 10)  # what it took is handed over, not dropped
        with pytest.raises(SamplingStopped):
            await asyncio.wait_for(waiting, 10)
        return taken

    try:
        taken = asyncio.run(run())
    finally:
        calls.shutdown()
    assert sorted(taken.keys.tolist()) == [1, 2]
    for lease in taken.lease_ids:
        table.release(lease)
    assert table.size() == 0
    table.close()
