"""Memory as the table fills: a table commits shared memory for the items it holds, not for max_size.

A max_size=1e6 table of 15 KB items must not reserve 15 GB of /dev/shm at the first
insert. These tests measure what the segment file really holds (its allocated
blocks), check that growth keeps every item and every learner's mapping valid, and that a
full shm directory is a clear RESOURCE_EXHAUSTED that leaves the daemon serving.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import time
import uuid

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import ShmExhausted
from gear_server.table.table import ItemToInsert
from tests.support.tables import make_table

ITEM_BYTES = 15_000
LEAF = pb.Structure()


def frame(key: int) -> ItemToInsert:
    """A 15 KB item (one step of 3,750 float32) whose values encode its key."""
    data = np.full((1, ITEM_BYTES // 4), key, np.float32)
    return ItemToInsert(key=key, priority=1.0, structure=LEAF, columns=[data], squeeze=[False])


def allocated(path: str) -> int:
    """Bytes of memory a segment file holds (allocated blocks, not its length)."""
    return os.stat(path).st_blocks * 512


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_million_slot_table_commits_memory_as_it_fills(store):
    rss_before = rss_bytes()
    table = make_table(store, max_size=1_000_000, sampler="fifo", remover="fifo")
    t0 = time.perf_counter()
    table.insert(frame(0))
    first_insert_s = time.perf_counter() - t0
    layout = table.layout()
    assert first_insert_s < 2.0, f"first insert took {first_insert_s:.2f} s"
    assert rss_bytes() - rss_before < 32 << 20, "the table and its first insert took more than 32 MiB of RSS"
    assert allocated(layout.segment) <= 2 << 20, "the first insert committed more than 2 MiB"
    assert layout.segment_size <= 32 << 20, "learners would map (and MAP_POPULATE) more than 32 MiB"
    n = 6_000  # 90 MB of items: several capacity growths and reservation steps
    for k in range(1, n):
        table.insert(frame(k))
    layout = table.layout()
    used = n * layout.columns[0].slot_stride
    assert layout.version > 0 and layout.capacity < 4 * n
    assert used <= allocated(layout.segment) <= used + (32 << 20) + (1 << 20)
    assert layout.segment_size <= 2 * used + (32 << 20)
    # every item is intact, in its slot
    snap = table.snapshot()
    data = snap.arrays["column/0"]
    assert snap.arrays["keys"].tolist() == list(range(n))
    np.testing.assert_array_equal(data[:, 0], np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(data.min(axis=1), data.max(axis=1))
    table.close()


def test_more_slots_lengthen_the_same_file_and_old_mappings_stay_valid(store):
    table = make_table(store, max_size=10_000, sampler="fifo", remover="fifo")
    table.insert(frame(0))
    first = table.layout()
    inode = os.stat(first.segment).st_ino
    with open(first.segment, "rb") as f:  # a learner maps the first layout
        learner = mmap.mmap(f.fileno(), first.segment_size, prot=mmap.PROT_READ)
    for k in range(1, first.capacity + 10):
        table.insert(frame(k))
    grown = table.layout()
    assert grown.capacity > first.capacity and grown.version > first.version
    assert grown.columns == first.columns  # offsets and strides of existing slots did not move
    assert os.stat(grown.segment).st_ino == inode and not os.path.exists(first.segment)  # renamed, not copied
    col = first.columns[0]
    for slot in (0, first.capacity - 1):  # the old mapping still reads what the table holds
        key = float(table.meta.key[slot])
        raw = np.frombuffer(learner, np.float32, ITEM_BYTES // 4, col.slot_offset(slot))
        assert raw[0] == key and raw[-1] == key
        del raw
    learner.close()
    table.close()


def test_a_longer_item_copies_only_the_used_slots(store):
    table = make_table(store, max_size=100_000, sampler="fifo", remover="fifo")
    for k in range(10):
        table.insert(frame(k))
    longer = np.full((2, ITEM_BYTES // 4), 99, np.float32)
    table.insert(ItemToInsert(key=99, priority=1.0, structure=LEAF, columns=[longer], squeeze=[False]))
    layout = table.layout()
    assert layout.columns[0].max_length == 2
    assert allocated(layout.segment) <= (1 << 20) + 11 * layout.columns[0].slot_stride
    sel = table.sample(11)
    keys = sel.keys.tolist()
    (data,) = table.read(sel)
    lengths = sel.lengths[:, 0].tolist()
    t = 0
    for key, ln in zip(keys, lengths, strict=True):
        assert (data[t:t + ln] == key).all()
        t += ln
    table.release(sel.lease_id)
    table.close()


# --------------------------------------------------------------------------- a full shm directory


@pytest.fixture
def small_tmpfs():
    """An 8 MiB tmpfs (needs root and mount rights, as in the project's CI containers)."""
    path = f"/tmp/gear-tmpfs-{uuid.uuid4().hex[:10]}"
    os.makedirs(path)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", path], capture_output=True)
    if done.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", path], check=False)
    os.rmdir(path)


def test_a_full_shm_directory_refuses_the_insert_naming_table_bytes_directory_and_remedy(small_tmpfs):
    from gear_client import Client
    from gear_client.errors import ServiceError
    from gear_server.daemon import Daemon
    from tests.support.tables import config

    server = Daemon(pb.ServerConfig(bind_address="127.0.0.1", port=0, shm_dir=small_tmpfs, instance_name="full",
                                    tables=[config("frames", sampler="fifo", remover="fifo", max_size=1000,
                                                   max_times_sampled=1)]))
    server.start()
    try:
        client = Client(f"localhost:{server.port}")
        frame_256k = np.zeros((256 << 10) // 4, np.float32)
        stored = 0
        with pytest.raises(ServiceError) as info:
            for k in range(100):  # 25 MiB of items into 8 MiB
                client.insert(frame_256k + k, {"frames": 1.0})
                stored += 1
        message = str(info.value)
        assert info.value.code.name == "RESOURCE_EXHAUSTED"
        assert "'frames'" in message and small_tmpfs in message and "--shm-size" in message
        assert "bytes" in message and any(ch.isdigit() for ch in message.split("needs")[1][:20])
        assert stored >= 28, "the table should hold what fits (8 MiB: 30 items of 256 KiB + headroom) before refusing"
        # nothing lost, the daemon serves: every stored item comes back intact
        got = [s[0].data[0] for s in client.sample("frames", stored)]
        assert len(got) == stored
        assert sorted(int(g[0]) for g in got) == list(range(stored))
        client.reset("frames")
        client.insert(frame_256k + 7, {"frames": 1.0})  # reserved memory is reused after a reset
        assert int(next(iter(client.sample("frames", 1)))[0].data[0][0]) == 7
    finally:
        server.stop()


def test_shm_exhausted_is_an_enospc_oserror_with_the_remedy():
    error = ShmExhausted("t", 123, "/dev/shm", "No space left on device")
    assert isinstance(error, OSError) and error.errno == 28
    assert "table 't' needs 123 more bytes" in str(error) and "/dev/shm" in str(error)
