"""What a same-host writer maps of a table's segment: the slots it writes, not the table's capacity.

A writer that populated every mapping of the segment whole paid, at each version the table grew
through, for every slot of it (an actor writing to N daemons paid N times), and allocated the
whole capacity of the sparse segment (tmpfs allocates pages on read faults) where the daemon
allocates rows as slots fill. Real daemon, real actor process, real shared memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gear_contract.slot_writer import populates_by_slot
from tests.support.insert_plane import items_in_insert_order, start
from tests.support.paths import ROOT
from tests.support.plane_daemon import table_config
from tests.support.trajectories import insert, make_item

pytestmark = pytest.mark.skipif(not populates_by_slot(), reason="kernel without MADV_POPULATE_READ (Linux < 5.14)")

LENGTH, DIM = 8, 1024  # 32 KiB of obs per item: a new segment starts with about 500 slots (16 MiB)

# Writes items seeds [first, first + count) through the ordinary TrajectoryWriter, then reports the
# bytes of the table's segment files this process has mapped in (Rss over every version's mapping).
ACTOR = """
import json, sys
from tests.support.trajectories import write_trajectories
address, prefix, first, count, length, dim = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])

def segment_rss():
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if head and not head[0].endswith(":"):
                inside = len(head) == 6 and head[5].strip().startswith(prefix)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total

print(json.dumps(write_trajectories(address, first, count, length, dim, end_episodes=False,
                                    report=lambda: {"rss": segment_rss()})))
"""


def run_actor(address: str, prefix: str, first: int, count: int) -> dict:
    out = subprocess.run([sys.executable, "-c", ACTOR, address, prefix, str(first), str(count), str(LENGTH), str(DIM)],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def allocated(path: str) -> int:
    """Bytes of memory a segment file holds (allocated blocks, not its length)."""
    return os.stat(path).st_blocks * 512


def check_items(table, seeds: list[int]) -> None:
    items = items_in_insert_order(table)
    assert [int(i["action"][0]) for i in items] == seeds
    for item in items:
        want = make_item(int(item["action"][0]), LENGTH, DIM)
        assert all(np.array_equal(item[k], want[k]) for k in want)


def test_a_writer_maps_and_commits_memory_for_the_slots_it_writes_not_the_whole_segment():
    d = start(table_config("t", 4096))
    try:
        table = d.tables["t"]
        insert(table, 1, length=LENGTH, dim=DIM)  # the layout, so the actor's items all take the plane
        layout = table.layout()
        prefix = layout.segment.rsplit(".v", 1)[0] + ".v"
        assert layout.segment_size >= 15 << 20
        result = run_actor(d.address(), prefix, 2, 6)
        assert result["insert_plane"]
        check_items(table, list(range(1, 8)))
        # 7 items and the writer's reservations (16 slots ahead) are about 0.8 MiB; the segment is 16 MiB
        assert result["rss"] <= 4 << 20, f"the writer mapped {result['rss']} bytes of a {layout.segment_size} segment"
        assert allocated(table.layout().segment) <= 4 << 20, "the segment holds more than its rows in use"
    finally:
        d.stop()


def test_a_writer_through_the_growths_of_a_table_maps_only_the_slots_of_the_newest_version_it_writes():
    """1100 items make the table grow twice (the same file lengthened: versions 1 -> 3): every item
    reads back exact, and the writer holds only the newest version's slots it reserved mapped."""
    d = start(table_config("t", 4096))
    try:
        table = d.tables["t"]
        insert(table, 1, length=LENGTH, dim=DIM)
        first = table.layout()
        prefix = first.segment.rsplit(".v", 1)[0] + ".v"
        result = run_actor(d.address(), prefix, 2, 1100)
        assert result["insert_plane"]
        layout = table.layout()
        assert layout.version >= first.version + 2 and layout.capacity >= 4 * first.capacity - 4
        check_items(table, list(range(1, 1102)))
        # about 100 slots reserved since the last growth (3 MiB); a whole version is 64 MiB
        assert result["rss"] <= layout.segment_size // 4, (
            f"the writer mapped {result['rss']} bytes of a {layout.segment_size} segment")
    finally:
        d.stop()
