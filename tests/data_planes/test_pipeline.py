"""The pipelined sampler: Selects sent ahead, answers taken in any order, no lease left behind."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

from gear_client.data_planes import sampler as sampler_module
from gear_client.data_planes.sampler import PlaneSampler

from ._support import check_batch, fill, insert, start_daemon, table_config


class Plane:
    kind = "shm"

    def __init__(self):
        self.mapped = []

    def set_layout(self, layout, region=None):
        self.mapped.append(layout.version)


class Answered:
    """A Select already answered (what PendingSelect.result() gives)."""

    def __init__(self, selection):
        self.selection = selection

    def result(self, timeout=None):
        return self.selection, set()


class Gather:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True
        return "batch"


def selection(lease, version, layout=None):
    return SimpleNamespace(lease_id=lease, layout_version=version, layout=layout, region=None)


def layout(version):
    return SimpleNamespace(version=version, columns=(0, 1, 2))


def test_answers_out_of_order_around_a_growth_are_followed_without_reopening():
    s = PlaneSampler(object(), "t")  # a stub stand-in: nothing is called on it
    plane = Plane()
    s._layout = layout(1)
    gathering = deque([(selection(7, 1), Gather())])
    verdicts, to_release = {}, []
    # a Select that already addresses the grown segment, answered before the one that brings its layout
    later = deque([Answered(selection(9, 2, layout(2)))])
    assert s._follow_layout(selection(8, 2), later, gathering, verdicts, to_release, plane) is None
    assert plane.mapped == [2] and s._layout.version == 2
    assert verdicts == {7: "batch"} and to_release == [7] and not gathering  # the old segment's reads are done
    # the answer that brings it is already followed; one selected before the growth is dropped unread
    assert s._follow_layout(selection(9, 2, layout(2)), deque(), gathering, verdicts, to_release, plane) is None
    assert s._follow_layout(selection(10, 1), deque(), gathering, verdicts, to_release, plane) is sampler_module._DROP
    assert plane.mapped == [2]
    # a newer segment nobody brings the layout of: recovery (re-open)
    assert s._follow_layout(selection(11, 3), deque(), gathering, verdicts, to_release, plane) is sampler_module._RETURN


def test_selects_are_sent_ahead_and_every_lease_ends_with_the_stream():
    d = start_daemon(table_config("t", 32))
    try:
        table = d.tables["t"]
        fill(table, 16, length=8, dim=16)
        with PlaneSampler(d.address(), "t") as s:
            stream = s.batches(2, depth=2, prefetch=3)
            assert check_batch(next(stream)) == 2
            deadline = time.monotonic() + 5
            while table.active_leases() < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            # held now: the Selects sent ahead, the gather running, the batch whose release goes next
            assert table.active_leases() >= 3
            insert(table, 99, length=20, dim=16)  # longer item: the table grows into a new segment
            insert(table, 98, length=20, dim=16)
            assert all(check_batch(next(stream)) == 2 for _ in range(10))
            assert s.reopens == 0 and s.stale_batches == 0
            stream.close()
            assert table.active_leases() == 0
    finally:
        d.stop()
