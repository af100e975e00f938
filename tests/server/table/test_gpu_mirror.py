"""The GPU mirror's bookkeeping over a real table, through its host-memory stand-in (no GPU needed).

Which items are mirrored (the whole table when it fits, else the most recent),
rows freed as items go, leased rows never rewritten, generations checked, and
every mirrored byte equal to the item it claims to hold, also under insert churn.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gear_client.data_planes.device import columns
from gear_contract._proto import replay_pb2 as pb
from gear_server.table.fitting import next_capacity_locked, regrow_locked
from gear_server.table.gpu_mirror import MirrorRefused
from gear_server.table.table import Table
from tests.support.tables import config, item


def mirrored_table(store, *, rows: int | None = None, max_size: int = 64, budget: int | None = None,
                   **kwargs) -> Table:
    """A table of ``tables.item`` items (3 steps) mirrored into ``rows`` rows of the host stand-in."""
    cfg = config(max_size=max_size, **kwargs)
    table = Table(cfg, store)
    table.insert(item(10_000))  # learns the layout, so the row size is known
    size = table.layout().columns[0].slot_stride
    table.reset()
    table.close()
    cfg.gpu_mirror.CopyFrom(pb.GpuMirror(device=0, bytes=budget or size * rows, backend="host"))
    return Table(cfg, store)


def row_size(table: Table) -> int:
    return table.layout().columns[0].slot_stride


def mirror_rows(table: Table) -> np.ndarray:
    m = table.mirror
    return m.rows_buffer.array[: m.num_rows * m.row_bytes].reshape(m.num_rows, m.row_bytes)


def check_rows(table: Table, rows: np.ndarray, keys: np.ndarray) -> int:
    """How many of ``rows`` (mirror rows) do not hold the item of the matching key (tables.item encodes it)."""
    act, obs = columns(mirror_rows(table)[rows], table.layout())
    bad = 0
    for a, o, key in zip(act[:, 0], obs, keys.tolist(), strict=True):
        expected = np.arange(6, dtype=np.float32).reshape(3, 2) + 1000 * key
        bad += int(a != key or not np.array_equal(o[:3], expected))
    return bad


def mirrored_keys(table: Table) -> set[int]:
    m = table.mirror
    used = m.row_generation > 0
    return {int(table.meta.key[s]) for s in m.row_slot[used].tolist()}


def test_whole_table_mirrored_and_every_row_matches_its_item(store):
    table = mirrored_table(store, rows=200, max_size=50)
    try:
        for k in range(1, 41):
            table.insert(item(k))
        assert table.mirror.flush(5)
        info = table.info().gpu_mirror
        assert (info.device, info.mirrored_items, info.copied_items) == (0, 40, 40)
        assert info.budget_bytes == 200 * row_size(table) and info.rows == 50 + 16  # at most max_size + spare
        selection = table.sample(40)
        rows = table.mirror.rows_for(selection.slots, selection.generations, row_size(table))
        assert (rows >= 0).all()
        assert check_rows(table, rows, selection.keys) == 0
        table.release(selection.lease_id)
    finally:
        table.close()


def test_every_item_is_mirrored_while_the_table_grows(store):
    """The table's capacity grows (its metadata arrays replaced) while the mirror copies a batch."""
    table = mirrored_table(store, rows=600, max_size=500)
    copy = table.mirror.rows_buffer.write
    grown: list[int] = []

    def copy_while_growing(*args) -> None:
        if not grown:
            grown.append(table.capacity)
            for k in range(2, 201):
                table.insert(item(k))
            core = table._core
            with core.lock:  # the growth inserts take when no slot is free
                regrow_locked(core, next_capacity_locked(core), None)
            grown.append(table.capacity)
        copy(*args)

    table.mirror.rows_buffer.write = copy_while_growing
    try:
        table.insert(item(1))
        assert table.mirror.flush(10)
        assert grown[1] > grown[0]
        assert mirrored_keys(table) == set(range(1, 201))
    finally:
        table.close()


def test_budget_keeps_the_most_recent_items(store):
    table = mirrored_table(store, rows=8, max_size=100)
    try:
        for k in range(1, 31):
            table.insert(item(k))
            if k % 5 == 0:
                assert table.mirror.flush(5)
        assert table.mirror.flush(5)
        assert mirrored_keys(table) == set(range(23, 31))
        selection = table.sample(100)
        rows = table.mirror.rows_for(selection.slots, selection.generations, row_size(table))
        hit = rows >= 0
        assert set(selection.keys[hit].tolist()) <= set(range(23, 31)) and hit.any() and not hit.all()
        assert check_rows(table, rows[hit], selection.keys[hit]) == 0
        table.release(selection.lease_id)
    finally:
        table.close()


def test_rows_go_with_their_items(store):
    table = mirrored_table(store, rows=16, max_size=100)
    try:
        for k in range(1, 11):
            table.insert(item(k))
        assert table.mirror.flush(5)
        table.mutate_priorities(deletes=[1, 2, 3])
        assert table.info().gpu_mirror.mirrored_items == 7
        assert mirrored_keys(table) == set(range(4, 11))
        table.reset()
        assert table.info().gpu_mirror.mirrored_items == 0
    finally:
        table.close()


def test_leased_rows_are_never_rewritten(store):
    table = mirrored_table(store, rows=4, max_size=4, sampler="fifo")
    try:
        for k in range(1, 5):
            table.insert(item(k))
        assert table.mirror.flush(5)
        selection = table.sample(4)  # every mirrored item leased
        rows = table.mirror.rows_for(selection.slots, selection.generations, row_size(table))
        assert (rows >= 0).all()
        before = mirror_rows(table)[rows].copy()
        for k in range(5, 21):  # evicts the leased items from the table; their rows must stay
            table.insert(item(k))
        assert table.mirror.flush(5)
        assert np.array_equal(mirror_rows(table)[rows], before)
        again = table.mirror.rows_for(selection.slots, selection.generations, row_size(table))
        assert np.array_equal(again, rows)  # still listed for the lease's generations
        assert table.info().gpu_mirror.mirrored_items == 4
        table.release(selection.lease_id)
        table.insert(item(21))
        assert table.mirror.flush(5)
        assert 21 in mirrored_keys(table)
    finally:
        table.close()


def test_a_generation_that_moved_is_not_listed(store):
    table = mirrored_table(store, rows=16)
    try:
        table.insert(item(1))
        assert table.mirror.flush(5)
        selection = table.sample(1)
        size = row_size(table)
        assert table.mirror.rows_for(selection.slots, selection.generations, size)[0] >= 0
        assert table.mirror.rows_for(selection.slots, selection.generations + 1, size)[0] == -1
        assert table.mirror.rows_for(selection.slots, selection.generations, size + 128)[0] == -1  # other row size
        table.release(selection.lease_id)
    finally:
        table.close()


def test_longer_items_relay_the_mirror(store):
    table = mirrored_table(store, rows=16)
    try:
        table.insert(item(1))
        assert table.mirror.flush(5)
        old = row_size(table)
        table.insert(item(2, length=40))  # a longer item: new segment, longer rows
        assert table.mirror.flush(5)
        assert row_size(table) > old and table.mirror.row_bytes == row_size(table)
        assert mirrored_keys(table) == {2}
    finally:
        table.close()


def test_no_torn_item_under_insert_churn(store):
    """Inserts replace the items while a reader samples and checks every mirrored item it is given."""
    table = mirrored_table(store, rows=24, max_size=32)
    stop = threading.Event()
    errors: list[BaseException] = []

    def insert() -> None:
        k = 1
        try:
            while not stop.is_set():
                table.insert(item(k))
                k += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    for k in range(100_000, 100_032):
        table.insert(item(k))
    writer = threading.Thread(target=insert)
    writer.start()
    checked = bad = 0
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline and checked < 20_000:
            selection = table.sample(16)
            rows = table.mirror.rows_for(selection.slots, selection.generations, row_size(table))
            hit = rows >= 0
            bad += check_rows(table, rows[hit], selection.keys[hit])
            checked += int(hit.sum())
            table.release(selection.lease_id)
    finally:
        stop.set()
        writer.join()
        table.close()
    assert not errors
    assert bad == 0
    assert checked > 100


def test_a_restored_table_mirrors_its_items(store):
    source = mirrored_table(store, rows=64, max_size=50)
    try:
        for k in range(1, 31):
            source.insert(item(k))
        snapshot = source.snapshot()
    finally:
        source.close()
    table = mirrored_table(store, rows=10, max_size=50)
    try:
        table.restore(snapshot)
        assert table.mirror.flush(5)
        assert mirrored_keys(table) == set(range(21, 31))  # the 10 most recent
        selection = table.sample(50)
        rows = table.mirror.rows_for(selection.slots, selection.generations, row_size(table))
        assert check_rows(table, rows[rows >= 0], selection.keys[rows >= 0]) == 0
        table.release(selection.lease_id)
    finally:
        table.close()


def test_a_bad_mirror_config_is_refused(store):
    cfg = config()
    cfg.gpu_mirror.CopyFrom(pb.GpuMirror(device=0, bytes=1 << 20, backend="tpu"))
    with pytest.raises(MirrorRefused, match="backend"):
        Table(cfg, store)
    cfg.gpu_mirror.CopyFrom(pb.GpuMirror(device=0, bytes=0, backend="host"))
    with pytest.raises(MirrorRefused, match="bytes must be > 0"):
        Table(cfg, store)
