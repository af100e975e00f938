"""Shared-memory segments: naming, mode 0600, exclusivity, unlink, stale cleanup, growth."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from gear_server.storage import SegmentStore, pid_alive, sanitise_table_name
from tests.support.tables import item, make_table


def test_segment_is_named_sized_mapped_and_mode_0600(store):
    seg = store.create("my table/1", 3, 10_000)
    name = os.path.basename(seg.path)
    assert name.startswith(f"gear.{store.instance}.{os.getpid()}.")
    assert name.endswith(".v3")
    assert "/" not in name[len("gear."):] and " " not in name
    st = os.stat(seg.path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size >= 10_000
    # writable mapping visible through the file
    seg.buffer[:4] = b"gear"
    with open(seg.path, "rb") as f:
        assert f.read(4) == b"gear"
    store.release(seg)
    assert not os.path.exists(seg.path)


def test_create_is_exclusive(store):
    store.create("t", 0, 4096)
    with pytest.raises(FileExistsError):
        store.create("t", 0, 4096)


def test_sanitised_names_stay_unique():
    assert sanitise_table_name("a/b") != sanitise_table_name("a_b")
    assert sanitise_table_name("a/b") == sanitise_table_name("a/b")
    assert set(sanitise_table_name("ü ../x")) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
    assert len(sanitise_table_name("x" * 500)) < 80


def test_bad_instance_name_rejected():
    with pytest.raises(ValueError, match="instance"):
        SegmentStore("/dev/shm", "a.b")


def test_close_unlinks_every_segment(store):
    paths = [store.create(f"t{i}", 0, 4096).path for i in range(3)]
    assert all(os.path.exists(p) for p in paths)
    store.close()
    assert not any(os.path.exists(p) for p in paths)
    assert store.paths() == []


def test_cleanup_stale_removes_dead_pids_of_any_instance_keeps_live_ones(store):
    # a pid that is certainly dead: a child that has exited and been reaped
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        shm = store.shm_dir
        dead_path = os.path.join(shm, f"gear.{store.instance}.{child.pid}.tbl-0.v0")
        live_path = os.path.join(shm, f"gear.{store.instance}.{live.pid}.tbl-0.v0")
        other_path = os.path.join(shm, f"gear.{store.instance}x.{child.pid}.tbl-0.v0")  # another instance, dead
        not_ours = os.path.join(shm, f"gearx.{store.instance}.{child.pid}.tbl-0.v0")  # not a segment's name
        for p in (dead_path, live_path, other_path, not_ours):
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.close(fd)
        own = store.create("mine", 0, 4096)
        removed = store.cleanup_stale()
        assert dead_path in removed and other_path in removed
        assert not os.path.exists(dead_path) and not os.path.exists(other_path)
        assert os.path.exists(live_path) and os.path.exists(not_ours) and os.path.exists(own.path)
    finally:
        live.kill()
        live.wait()
        for p in (live_path, other_path, not_ours):
            if os.path.exists(p):
                os.unlink(p)


_DAEMON_CHILD = """
import os, sys, time
from gear_server.storage import SegmentStore
store = SegmentStore(sys.argv[1], sys.argv[2])
segment = store.create("replay", 0, 1 << 20)
segment.reserve(0, 1 << 20)
print(segment.path, flush=True)
time.sleep(60)
"""


def _segment_owner(instance: str) -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen([sys.executable, "-c", _DAEMON_CHILD, "/dev/shm", instance], stdout=subprocess.PIPE,
                             text=True)
    return child, child.stdout.readline().strip()


def test_a_sigkilled_daemons_segments_are_removed_by_a_daemon_of_another_instance(store):
    child, path = _segment_owner(f"{store.instance}killed")
    try:
        assert os.path.exists(path)
        assert path not in store.cleanup_stale()  # alive: kept
        child.kill()
        child.wait()
        assert path in store.cleanup_stale()
        assert not os.path.exists(path)
    finally:
        child.kill()
        child.wait()
        if os.path.exists(path):
            os.unlink(path)


def test_a_segment_locked_by_a_live_daemon_is_kept_even_if_its_pid_is_not_visible(store):
    """A daemon in another pid namespace sharing /dev/shm: its pid means nothing here, its lock does."""
    child, path = _segment_owner(f"{store.instance}ns")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    renamed = path.replace(f".{child.pid}.", f".{dead.pid}.")
    try:
        os.rename(path, renamed)  # as if its pid were one that is not alive in this namespace
        assert renamed not in store.cleanup_stale()
        assert os.path.exists(renamed)
        child.kill()
        child.wait()
        assert renamed in store.cleanup_stale()
    finally:
        child.kill()
        child.wait()
        for p in (path, renamed):
            if os.path.exists(p):
                os.unlink(p)


def test_table_segment_lifecycle_and_growth_unlinks_old(store):
    table = make_table(store, max_size=8)
    assert table.layout() is None
    table.insert(item(1, length=2))
    first = table.layout()
    assert os.path.exists(first.segment)
    assert stat.S_IMODE(os.stat(first.segment).st_mode) == 0o600
    assert first.segment_size <= os.stat(first.segment).st_size
    # every column offset and slot stride is 128-byte aligned
    for col in first.columns:
        assert col.offset % 128 == 0 and col.slot_stride % 128 == 0
    table.insert(item(2, length=9))  # longer: the layout grows into a new segment
    second = table.layout()
    assert second.version == first.version + 1
    assert not os.path.exists(first.segment)
    assert os.path.exists(second.segment)
    # a learner can map the file and find item bytes where the layout says
    sel = table.sample(1)
    table.release(sel.lease_id)
    with open(second.segment, "rb") as f:
        raw = np.frombuffer(f.read(), np.uint8)
    obs_col = second.columns[1]
    slot = table.slot_of(1)
    data = raw[obs_col.slot_offset(slot): obs_col.slot_offset(slot) + 2 * obs_col.step_bytes].view(np.float32)
    np.testing.assert_array_equal(data, np.arange(4, dtype=np.float32) + 1000)
    table.close()
    assert not os.path.exists(second.segment)
