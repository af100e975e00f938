"""The pipelined sampler: Selects sent ahead, answers taken in any order, no lease left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gear_client.data_planes import shm as shm_module
from gear_client.data_planes.batch import Pending, SampledBatch
from gear_client.data_planes.sampler import LayoutStep, PipelineState, PlaneSampler, SamplerClosedError
from gear_contract._proto import replay_pb2 as pb
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill, insert

ROOT = Path(__file__).resolve().parents[2]


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
    state = PipelineState(2)
    state.gathering.append((7, Gather()))
    # a Select that already addresses the grown segment, answered before the one that brings its layout
    state.selects = deque([Answered(selection(9, 2, layout(2)))])
    assert s._follow_layout(selection(8, 2), state, plane) is LayoutStep.GATHER
    assert plane.mapped == [2] and s._layout.version == 2
    # the old segment's reads are done: the lease may go, its items wait for the verdict
    assert state.verdicts == {7: "batch"} and state.to_release == [7] and not state.gathering
    # the answer that brings it is already followed; one selected before the growth is dropped unread
    state.selects = deque()
    assert s._follow_layout(selection(9, 2, layout(2)), state, plane) is LayoutStep.GATHER
    assert s._follow_layout(selection(10, 1), state, plane) is LayoutStep.DROP
    assert plane.mapped == [2]
    # a newer segment nobody brings the layout of: recovery (re-open)
    assert s._follow_layout(selection(11, 3), state, plane) is LayoutStep.RECOVER


def items(n: int) -> SampledBatch:
    """n items whose every field says which item it is."""
    i = np.arange(n)
    columns = [i.astype(np.int64).reshape(n, 1), np.repeat(i, 6).reshape(n, 3, 2).astype(np.float32)]
    return SampledBatch(i.astype(np.uint64), i / n, np.full(n, n), i * 2.0, i.astype(np.int32), columns,
                        np.ones((n, 2), np.int32), pb.Structure(), (False, False), plane="shm")


def test_one_gather_of_several_batches_is_judged_and_handed_out_batch_by_batch():
    state = PipelineState(4)
    state.gathering.extend([(1, Pending(None, items(10))), (2, Pending(None, items(8)))])
    state.finish_oldest()
    assert state.to_release == [1] and not state.ready  # gathered: the lease may go; the verdict comes later
    state.finish_all()
    assert state.judge([1], stale=set()) == 0
    assert [len(b) for b in state.ready] == [4, 4, 2]
    assert np.array_equal(np.concatenate([b.keys for b in state.ready]), np.arange(10))
    assert all(np.array_equal(b.columns[1][:, 0, 0], b.keys.astype(np.float32)) for b in state.ready)
    assert state.judge([2], stale={2}) == 2 and len(state.ready) == 3  # a stale lease drops all its batches
    assert items(4).split(4)[0].keys is not None and len(items(3).split(4)) == 1


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


def test_closing_the_sampler_while_a_pipeline_runs_ends_it_with_sampler_closed():
    """close() from another thread at any point of the pipeline: SamplerClosedError, never a gather on a freed plane."""
    d = start_daemon(table_config("t", 32))
    try:
        fill(d.tables["t"], 16, length=8, dim=256)
        outcomes = []
        for trial in range(15):
            s = PlaneSampler(d.address(), "t")
            s.open()

            def consume(sampler=s):
                try:
                    for _ in sampler.batches(4):
                        pass
                except SamplerClosedError:
                    outcomes.append("closed")
                except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                    outcomes.append(repr(exc))

            consumer = threading.Thread(target=consume)
            consumer.start()
            time.sleep(0.01 + 0.003 * (trial % 7))  # close at different points of the pipeline
            s.close()
            consumer.join(10)
            assert not consumer.is_alive()
        assert outcomes == ["closed"] * 15
        deadline = time.monotonic() + 5
        while d.tables["t"].active_leases() and time.monotonic() < deadline:
            time.sleep(0.01)  # the daemon ends the closed sessions' leases
        assert d.tables["t"].active_leases() == 0
    finally:
        d.stop()


_EXITING_LEARNER = """
import sys
from gear_client.data_planes.sampler import PlaneSampler
stream = PlaneSampler(sys.argv[1], "t").batches(2)
for _ in range(5):
    next(stream)
print("exiting with Selects in flight", flush=True)
"""


def test_a_learner_exiting_with_a_pipeline_open_ends_its_session_at_exit():
    """Closed at exit while gRPC still runs (a call made during finalization can hang): the leases end at once."""
    d = start_daemon(table_config("t", 16), lease_timeout_s=60, idle_timeout_s=60)
    try:
        table = d.tables["t"]
        fill(table, 8, length=4, dim=4)
        out = subprocess.run([sys.executable, "-c", _EXITING_LEARNER, d.address()], capture_output=True, text=True,
                             timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0 and "exiting" in out.stdout, out.stderr
        deadline = time.monotonic() + 5
        while (table.active_leases() or len(d.manager.sessions)) and time.monotonic() < deadline:
            time.sleep(0.02)
        # far sooner than the 60 s lease and idle timeouts: the session was closed, not reaped
        assert table.active_leases() == 0 and len(d.manager.sessions) == 0
    finally:
        d.stop()


def test_a_failing_gather_ends_the_stream_with_its_error_and_no_lease_left(monkeypatch):
    d = start_daemon(table_config("t", 32))
    try:
        table = d.tables["t"]
        fill(table, 16, length=8, dim=16)
        gather = shm_module.gather_numpy
        calls = iter(range(1000))

        def failing_gather(*args, **kwargs):
            if next(calls) == 4:
                raise OSError("the segment went away")
            return gather(*args, **kwargs)

        monkeypatch.setattr(shm_module, "gather_numpy", failing_gather)
        with PlaneSampler(d.address(), "t") as s:
            stream = s.batches(2)
            with pytest.raises(OSError, match="segment went away"):
                for _ in range(20):
                    check_batch(next(stream))
            assert table.active_leases() == 0  # the failed gather's lease too, not left to its 60 s timeout
    finally:
        d.stop()
