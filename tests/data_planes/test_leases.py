"""Leases: expiry of dead learners' leases, idle sessions, stale detection, and no torn read under churn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gear_client.data_planes import sampler as sampler_module
from gear_client.data_planes import shm as shm_module
from gear_client.data_planes.sampler import PlaneSampler
from gear_server.data_planes.sessions import SessionRegistry, generations_unchanged
from gear_server.storage import SegmentStore
from gear_server.table.table import Table
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import Churn, check_batch, fill, insert, item_ok, make_item

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table(tmp_path):
    store = SegmentStore(str(tmp_path), f"lease{os.getpid()}")
    t = Table(table_config("t", max_size=4), store, seed=0, spare_slots=1)
    fill(t, 4, length=8, dim=4)
    yield t
    t.close()
    store.close()


def test_an_expired_lease_is_released_and_reported_stale(table):
    clock = Clock()
    reg = SessionRegistry(lease_timeout_s=5, idle_timeout_s=60, clock=clock)
    session = reg.create(table, "shm")
    sel = table.sample(2)
    lease = reg.add_lease(session, [sel.lease_id], sel.slots, sel.generations)
    clock.now += 4.9
    assert reg.reap() == (0, 0) and table.active_leases() == 1
    clock.now += 0.2
    assert reg.reap() == (1, 0)
    assert table.active_leases() == 0  # the dead learner's slots can be reused
    assert reg.release(session, [lease]) == [lease]


def test_a_rewritten_slot_makes_its_lease_stale(table):
    clock = Clock()
    reg = SessionRegistry(lease_timeout_s=5, idle_timeout_s=60, clock=clock)
    session = reg.create(table, "shm")
    sel = table.sample(4)
    reg.add_lease(session, [sel.lease_id], sel.slots, sel.generations)
    fill(table, 8, start=100, length=8, dim=4)  # evicts them, but the lease keeps the slots untouched
    assert generations_unchanged(table, sel.slots, sel.generations)
    clock.now += 10
    assert reg.reap() == (1, 0)  # expired: the table may now reuse the slots
    fill(table, 8, start=200, length=8, dim=4)  # evicts and rewrites them
    assert not generations_unchanged(table, sel.slots, sel.generations)


def test_releasing_in_time_is_not_stale_and_frees_the_slots(table):
    reg = SessionRegistry(lease_timeout_s=5, idle_timeout_s=60, clock=Clock())
    session = reg.create(table, "shm")
    sel = table.sample(3)
    lease = reg.add_lease(session, [sel.lease_id], sel.slots, sel.generations)
    assert reg.release(session, [lease]) == [] and table.active_leases() == 0
    assert reg.active_leases() == 0


def test_idle_sessions_are_closed_with_their_leases(table):
    clock = Clock()
    closed = []
    reg = SessionRegistry(lease_timeout_s=50, idle_timeout_s=30, clock=clock, on_close=closed.append)
    session = reg.create(table, "rdma", resources="queue pairs")
    sel = table.sample(1)
    reg.add_lease(session, [sel.lease_id], sel.slots, sel.generations)
    clock.now += 20
    reg.get(session.session_id)  # a call keeps it alive
    clock.now += 20
    assert reg.reap() == (0, 0)
    clock.now += 31
    assert reg.reap() == (0, 1)
    assert len(reg) == 0 and table.active_leases() == 0 and closed[0].resources == "queue pairs"
    assert reg.add_lease(session, [table.sample(1).lease_id], sel.slots, sel.generations) is None
    assert table.active_leases() == 0  # a lease taken for a closed session is given back at once


def test_the_reaper_thread_frees_the_leases_of_a_learner_that_died():
    d = start_daemon(table_config("t", 16), lease_timeout_s=0.3, idle_timeout_s=60, reap_interval_s=0.05)
    try:
        fill(d.tables["t"], 8, length=4, dim=4)
        code = ("import sys, os; from gear_client.data_planes.sampler import PlaneSampler;"
                "s = PlaneSampler(sys.argv[1], 't'); sel = s._sample_locked  # noqa\n"
                "s.open(); s._session.select(4, 3, None); os._exit(0)")
        out = subprocess.run([sys.executable, "-c", code, d.address()], capture_output=True, text=True, timeout=60,
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, out.stderr
        assert d.tables["t"].active_leases() == 1  # the learner died holding a lease
        deadline = time.monotonic() + 5
        while d.tables["t"].active_leases() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.tables["t"].active_leases() == 0
    finally:
        d.stop()


def test_a_deliberately_torn_item_fails_its_checksum():
    a, b = make_item(1, 16, 64), make_item(2, 16, 64)
    torn = a["obs"].copy()
    torn[8:] = b["obs"][8:]
    assert item_ok(a["action"], a["obs"], a["reward"])
    assert not item_ok(a["action"], torn, a["reward"])


def test_slow_reads_past_the_lease_timeout_are_discarded_not_returned(monkeypatch):
    """Leases expire while the learner reads; Release says stale and the batch is selected again."""
    d = start_daemon(table_config("t", 8), lease_timeout_s=0.05, idle_timeout_s=60, reap_interval_s=0.01)
    try:
        fill(d.tables["t"], 8, length=16, dim=64)
        gather = shm_module.gather_numpy
        slow = iter([True, False] * 1000)

        def slow_gather(*args, **kwargs):
            moved = gather(*args, **kwargs)
            if next(slow):
                time.sleep(0.15)  # well past the lease: the slots may be rewritten meanwhile
            return moved

        monkeypatch.setattr(shm_module, "gather_numpy", slow_gather)
        with Churn(d.tables["t"], length=16, dim=64), PlaneSampler(d.address(), "t") as s:
            items = sum(check_batch(s.sample(4)) for _ in range(6))
            assert s.kind == "shm" and items == 24
            assert s.stale_batches >= 6  # every slow read came back stale and was dropped
    finally:
        d.stop()


_LEARNER = """
import json, sys, time
from gear_client.data_planes.sampler import PlaneSampler
from tests.support.trajectories import item_ok
s = PlaneSampler(sys.argv[1], "t")
items = torn = batches = 0
end = time.monotonic() + float(sys.argv[2])
stream = s.batches(8) if sys.argv[3] == "pipelined" else None
while time.monotonic() < end or items < 80:  # at least 80 items however slow the machine
    b = next(stream) if stream is not None else s.sample(8)
    batches += 1
    a, o, r = b.columns
    for i in range(len(b)):
        n = int(b.lengths[i, 0])
        items += 1
        if not item_ok(a[i, :n], o[i, :n], r[i, :n]) or int(a[i, 0]) != int(b.keys[i]):
            torn += 1
print(json.dumps({"kind": s.kind, "items": items, "torn": torn, "batches": batches, "stale": s.stale_batches}))
"""


def test_no_torn_read_while_inserts_evict_at_full_speed():
    """Two learner processes sample over shm while a writer inserts (and so evicts) as fast as it can.

    One samples batch by batch (Select, gather, Release), the other pipelined (the
    next Select, which also ends the previous lease, runs while a batch is gathered).
    """
    d = start_daemon(table_config("t", 16), lease_timeout_s=10)
    try:
        table = d.tables["t"]
        fill(table, 16)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with Churn(table) as churn:
            learners = [subprocess.Popen([sys.executable, "-c", _LEARNER, d.address(), "4", mode],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                        for mode in ("one-by-one", "pipelined")]
            results = []
            for p in learners:
                out, err = p.communicate(timeout=90)
                assert p.returncode == 0, err
                results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        d.stop()
    assert all(r["kind"] == "shm" for r in results)
    assert sum(r["torn"] for r in results) == 0, results
    assert all(r["items"] >= 80 for r in results), results
    assert churn.inserted > 10 * 16, "the writer did not churn the table"  # every slot rewritten many times


def test_generation_check_tolerates_a_grown_table():
    d = start_daemon(table_config("t", 4))
    try:
        t = d.tables["t"]
        insert(t, 1, length=4, dim=4)
        with PlaneSampler(d.address(), "t") as s:
            first = s.sample(1)
            insert(t, 2, length=12, dim=4)  # longer item: the table regrows into a new segment
            insert(t, 3, length=12, dim=4)
            batches = [s.sample(4) for _ in range(3)]
            assert first.plane == "shm" and all(b.plane == "shm" for b in batches)
            assert all(check_batch(b) == 4 for b in batches)
            assert batches[-1].columns[1].shape[1] >= 12 and s.reopens == 0
            assert np.all(batches[-1].lengths[:, 1] >= 4)
    finally:
        d.stop()


def test_unleased_reads_under_the_same_churn_do_tear():
    """The control: a reader copying slots without a lease while the writer churns gets torn items.

    Reader and writer go in lockstep rather than racing (a race that a loaded machine may never lose):
    the reader copies the first column of every slot, the writer inserts as many items as the table
    holds slots (FIFO eviction: every slot is rewritten), then the reader copies the other columns.
    Nothing stops the table from reusing a slot under a reader that holds no lease, so every slot
    read that way is torn, and the checksum sees it.
    """
    from gear_client.data_planes.shm import SegmentMapping

    d = start_daemon(table_config("t", 16))
    try:
        table = d.tables["t"]
        fill(table, 16)
        layout = table.layout()
        mapping = SegmentMapping(layout)
        action, obs, reward = (layout.column_view(mapping.buffer, c) for c in range(3))
        slots = [s for s in range(layout.capacity) if action[s][0] != 0]  # the slots holding an item
        assert len(slots) == 16
        first = {s: action[s].copy() for s in slots}  # the reader is part-way through every item
        with Churn(table) as churn:  # the writer rewrites every slot, as fast as it can
            while churn.inserted < 2 * layout.capacity:
                time.sleep(0.001)
        assert table.layout().version == layout.version  # same segment: the mapping sees the rewrites
        torn = sum(not item_ok(first[s], obs[s].copy(), reward[s].copy()) for s in slots)
        intact = [s for s in slots if item_ok(action[s], obs[s], reward[s])]
        del action, obs, reward
        mapping.close()
    finally:
        d.stop()
    assert len(intact) == len(slots), "the slots hold whole items once the writer stopped"
    assert torn == len(slots), f"{torn} of {len(slots)} unleased reads torn: the churn test would prove nothing"


def test_pipelined_batches_drop_stale_ones_and_leave_no_lease_behind(monkeypatch):
    d = start_daemon(table_config("t", 8), lease_timeout_s=0.05, idle_timeout_s=60, reap_interval_s=0.01)
    try:
        fill(d.tables["t"], 8, length=16, dim=64)
        gather = shm_module.gather_numpy
        slow = iter([True, False, False] * 1000)

        def slow_gather(*args, **kwargs):
            moved = gather(*args, **kwargs)
            if next(slow):
                time.sleep(0.15)
            return moved

        monkeypatch.setattr(shm_module, "gather_numpy", slow_gather)
        with Churn(d.tables["t"], length=16, dim=64), PlaneSampler(d.address(), "t") as s:
            stream = s.batches(4)
            items = sum(check_batch(next(stream)) for _ in range(8))
            assert items == 32 and s.stale_batches >= 3
            stream.close()
            assert d.tables["t"].active_leases() == 0  # the leases in flight were released
    finally:
        d.stop()


def test_pipelined_batches_follow_a_growing_table_without_resampling():
    d = start_daemon(table_config("t", 8))
    try:
        t = d.tables["t"]
        with PlaneSampler(d.address(), "t") as s:
            stream = s.batches(2, batches_per_select=1)
            fill(t, 2, length=4, dim=8)  # the first Select brings the first layout
            first = next(stream)
            insert(t, 50, length=20, dim=8)  # grows into a new segment
            insert(t, 51, length=20, dim=8)
            later = [next(stream) for _ in range(6)]
            assert check_batch(first) == 2 and all(check_batch(b) == 2 for b in later)
            assert s.reopens == 0 and later[-1].columns[1].shape[1] == 20
            stream.close()
        info = t.info()
        completed = info.rate_limiter_info.sample_stats.completed
        # delivered, or in flight when closed (gathers running, Selects sent ahead, batches awaiting their
        # verdict: 5 batches at most), or the one Select answered before the growth but read after it (dropped)
        assert 14 <= completed <= 14 + 2 * (sampler_module.PIPELINE_DEPTH - 1 + 2 * sampler_module.PIPELINE_PREFETCH)
    finally:
        d.stop()
