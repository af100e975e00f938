"""A table that grows again before the learner maps the layout a Select brought.

The daemon attaches the table's current layout to a Select answer; if the
table grows once more before the learner maps that segment, the segment's file
is already unlinked (ENOENT). The learner must then follow the newer layout a
later answer brings, on the same plane, instead of dropping to inline for good.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

from gear_client.data_planes.sampler import MAX_OUTGROWN_LAYOUTS, LayoutStep, PipelineState, PlaneSampler
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill, insert


def grow_after_each_layout_sent(daemon, table, growths: int) -> list[str]:
    """Make the daemon's next ``growths`` layout-bearing Select answers outdated at once.

    Right after an answer is given the table's current layout, an item twice as
    long is inserted: the table moves to a new segment and unlinks the one just
    sent. Returns the paths of the segments sent that way (filled as it happens).
    """
    manager = daemon.manager
    original = manager._send_layout
    sent: list[str] = []
    lock = threading.Lock()

    def send_then_grow(session, tbl, response, context):
        original(session, tbl, response, context)
        with lock:
            if len(sent) >= growths:
                return
            sent.append(tbl.layout().segment)
            length = 2 * max(c.max_length for c in tbl.layout().columns)
        insert(table, 10_000 + len(sent), length=length, dim=16)

    manager._send_layout = send_then_grow
    return sent


def test_a_pipeline_follows_a_layout_whose_segment_is_already_gone(caplog):
    d = start_daemon(table_config("t", 32))
    try:
        table = d.tables["t"]
        fill(table, 16, length=8, dim=16)
        sent = grow_after_each_layout_sent(d, table, growths=3)
        with PlaneSampler(d.address(), "t") as s:
            stream = s.batches(4, depth=3, prefetch=3)
            assert check_batch(next(stream)) == 4
            insert(table, 99, length=16, dim=16)  # a growth: the next answers bring its layout
            deadline = time.monotonic() + 20
            checked = 0
            while (len(sent) < 3 or checked < 40 or s._layout.version != table.layout().version) \
                    and time.monotonic() < deadline:  # batches selected before a growth come first
                checked += check_batch(next(stream))
            assert len(sent) == 3, "the daemon did not send the layouts the test outdates"
            assert not any(os.path.exists(path) for path in sent)  # each was unlinked before the learner mapped it
            assert s.kind == "shm" and s.reopens == 0 and not s._excluded, "the learner left the shm plane"
            assert "falling back" not in caplog.text
            assert s.outgrown_layouts >= 1 and s._layout.version == table.layout().version
            stream.close()
            assert table.active_leases() == 0
        assert "falling back" not in caplog.text
    finally:
        d.stop()


def test_one_by_one_sampling_follows_a_layout_whose_segment_is_already_gone(caplog):
    d = start_daemon(table_config("t", 32))
    try:
        table = d.tables["t"]
        fill(table, 16, length=8, dim=16)
        sent = grow_after_each_layout_sent(d, table, growths=2)
        with PlaneSampler(d.address(), "t") as s:
            assert check_batch(s.sample(4)) == 4
            insert(table, 99, length=16, dim=16)
            for _ in range(10):
                assert check_batch(s.sample(4)) == 4
            assert len(sent) == 2 and not any(os.path.exists(path) for path in sent)
            assert s.kind == "shm" and s.reopens == 0 and not s._excluded, "the learner left the shm plane"
            assert "falling back" not in caplog.text
            assert table.active_leases() == 0
        assert "falling back" not in caplog.text
    finally:
        d.stop()


def test_leases_held_while_a_small_table_grows_repeatedly_keep_the_shm_plane(caplog):
    """Pipelined learners pin many slots of a 4-item table while a writer inserts: capacity grows in a row."""
    d = start_daemon(table_config("t", 4))
    try:
        table = d.tables["t"]
        fill(table, 4, length=8, dim=64)
        stop = threading.Event()

        def writer():
            seed = 100
            while not stop.is_set():
                insert(table, seed, length=8, dim=64)
                seed += 1

        samplers = [PlaneSampler(d.address(), "t") for _ in range(3)]
        streams = [s.batches(8, depth=4, prefetch=4) for s in samplers]
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            first = table.layout().version
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                for stream in streams:
                    check_batch(next(stream))
                time.sleep(0.01)  # leases outlive several inserts: evicted slots stay pinned, capacity grows
            grown = table.layout().version - first
            for s in samplers:
                assert s.kind == "shm" and not s._excluded, "a learner left the shm plane"
        finally:
            stop.set()
            thread.join(10)
            for s, stream in zip(samplers, streams, strict=True):
                stream.close()
                s.close()
        assert grown >= 2, f"the table grew {grown} times"
        assert table.active_leases() == 0
        assert "falling back" not in caplog.text
    finally:
        d.stop()


def test_a_segment_that_never_shows_up_still_falls_back():
    """ENOENT layout after layout (another /dev/shm behind one host identity) is no growth race: fall back."""

    class Unmappable:
        kind = "shm"

        def set_layout(self, layout, region=None):
            raise FileNotFoundError(2, "No such file or directory", f"/dev/shm/x.v{layout.version}")

    s = PlaneSampler(object(), "t")  # a stub stand-in: nothing is called on it
    s._layout = SimpleNamespace(version=1, columns=(0, 1, 2))
    state = PipelineState(4)
    outcomes = []
    for version in range(2, MAX_OUTGROWN_LAYOUTS + 3):
        answer = SimpleNamespace(lease_id=version, layout_version=version, region=None,
                                 layout=SimpleNamespace(version=version, columns=(0, 1, 2)))
        outcomes.append(s._follow_layout(answer, state, Unmappable()))
    assert outcomes[:MAX_OUTGROWN_LAYOUTS] == [LayoutStep.DROP] * MAX_OUTGROWN_LAYOUTS
    assert outcomes[MAX_OUTGROWN_LAYOUTS] is LayoutStep.RECOVER and "shm" in s._excluded
    # an answer addressing a segment known gone is released unread, without trying to map it
    stale = SimpleNamespace(lease_id=99, layout_version=3, layout=None, region=None)
    assert s._follow_layout(stale, state, Unmappable()) is LayoutStep.DROP
    assert s._layout.version == 1 and s.outgrown_layouts == MAX_OUTGROWN_LAYOUTS
