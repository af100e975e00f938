"""TrajectoryDataset / TimestepDataset over the data planes, and Client.sample using the negotiated plane."""

from __future__ import annotations

import time

import numpy as np
import pytest

import gear_client as reverb
from gear_client.data_planes.batch import BufferPool
from gear_kernels import Window
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill, item_ok


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(table_config("t", 64), table_config("empty", 8), table_config("fifo", 64, sampler="fifo"),
                     table_config("steps", 64))
    fill(d.tables["t"], 48, length=32, dim=128)
    fill(d.tables["fifo"], 20, length=8, dim=16)
    yield d
    d.stop()


def test_batches_have_fixed_shapes_infos_and_intact_items(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=16, max_samples=64) as ds:
        samples = list(ds)
        assert ds.plane == "shm"
    assert len(samples) == 4
    for s in samples:
        assert set(s.data) == {"obs", "action", "reward"}
        assert s.data["obs"].shape == (16, 32, 128) and s.data["obs"].dtype == np.float32
        assert s.data["action"].shape == (16, 32) and s.info.key.shape == (16,)
        assert s.info.key.dtype == np.uint64 and s.info.times_sampled.dtype == np.int32
        for i in range(16):
            assert item_ok(s.data["action"][i], s.data["obs"][i], s.data["reward"][i])
            assert int(s.data["action"][i, 0]) == int(s.info.key[i])


def test_windows_and_lengths(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=8, window=Window(40, -40, "head"),
                                  max_samples=8) as ds:
        (batch,) = list(ds.batches())
    assert batch.columns[1].shape == (8, 40, 128)
    assert np.all(batch.lengths == 32)
    assert np.all(batch.columns[1][:, :8] == 0)  # head padding, written by the gather
    table = daemon.tables["t"]
    view = table.layout().column_view(table.segment.buffer, 1)
    for i, key in enumerate(batch.keys.tolist()):
        slot = int(np.flatnonzero(table.meta.key == key)[0])
        assert np.array_equal(batch.columns[1][i, 8:], view[slot, :32])


def test_max_samples_ends_the_iteration_with_a_short_last_batch(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=10) as ds:
        sizes = [len(b) for b in ds.batches()]
    assert sizes == [4, 4, 2]


def test_rate_limiter_timeout_ends_the_stream(daemon):
    start = time.monotonic()
    with reverb.TrajectoryDataset(daemon.address(), "empty", batch_size=2, rate_limiter_timeout_ms=300) as ds:
        assert list(ds) == []
    assert time.monotonic() - start < 5


def test_close_stops_a_producer_blocked_on_an_empty_table(daemon):
    ds = reverb.TrajectoryDataset(daemon.address(), "empty", batch_size=2)
    time.sleep(0.5)  # the producer is now blocked in Select
    start = time.monotonic()
    ds.close()
    assert time.monotonic() - start < 5 and not ds._thread.is_alive()
    assert list(ds) == []
    assert len(daemon.manager.sessions) == 0 or all(
        s.table.name != "empty" for s in daemon.manager.sessions._sessions.values())


def test_batches_are_prefetched_while_the_learner_is_busy(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, prefetch=3) as ds:
        deadline = time.monotonic() + 5
        while ds._queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ds._queue.qsize() == 3  # ready before the learner asked
        check_batch(next(ds.batches()))


def test_an_unknown_table_raises_in_the_consumer(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "nope", batch_size=2) as ds:
        with pytest.raises(RuntimeError, match="nope"):
            next(ds)


def test_bad_arguments_are_refused(daemon):
    with pytest.raises(ValueError):
        reverb.TrajectoryDataset(daemon.address(), "t", batch_size=0)
    with pytest.raises(ValueError):
        reverb.TrajectoryDataset(daemon.address(), "t", batch_size=2, output="tensorflow")
    with pytest.raises(ValueError):
        reverb.TrajectoryDataset(daemon.address(), "t", batch_size=2, planes=["bluetooth"])


def test_timestep_dataset_drops_the_time_dimension(daemon):
    client = reverb.Client(daemon.address())
    for k in range(6):
        client.insert({"x": np.full(3, k, np.float32), "y": np.int32(k)}, {"steps": 1.0})
    with reverb.TimestepDataset(daemon.address(), "steps", batch_size=5, max_samples=5) as ds:
        (s,) = list(ds)
    assert s.data["x"].shape == (5, 3) and s.data["y"].shape == (5,)
    assert np.all(s.data["x"][:, 0] == s.data["y"])


def test_client_sample_uses_shm_on_the_daemons_host_with_reverb_semantics(daemon):
    client = reverb.Client(daemon.address())
    samples = list(client.sample("t", 20, emit_timesteps=False))
    assert client._planes["t"].kind == "shm"
    assert len(samples) == 20
    for s in samples:
        action, obs, reward = s.data  # flat leaves, as Reverb gives without a signature
        assert isinstance(s.info.key, int) and isinstance(s.info.probability, float)
        assert obs.shape == (32, 128) and item_ok(action, obs, reward) and int(action[0]) == s.info.key
    steps = next(client.sample("t", 1))  # emit_timesteps: one ReplaySample per step
    assert len(steps) == 32 and steps[0].data[1].shape == (128,)
    client.close()


def test_client_sample_gives_the_same_items_over_shm_and_inline(daemon, monkeypatch):
    shm_client = reverb.Client(daemon.address())
    first = next(shm_client.sample("fifo", 1, emit_timesteps=False))
    assert shm_client._planes["fifo"].kind == "shm"
    monkeypatch.setattr(reverb.Client, "_data_plane", lambda self, table: None)
    inline_client = reverb.Client(daemon.address())
    second = next(inline_client.sample("fifo", 1, emit_timesteps=False))
    assert first.info.key == second.info.key  # FIFO: the same oldest item
    assert second.info.times_sampled == first.info.times_sampled + 1
    for a, b in zip(first.data, second.data, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    shm_client.close()


def test_buffer_pool_reuses_only_buffers_nobody_holds():
    pool = BufferPool()
    a = pool.get(1000)
    a_id = id(a)
    view = a[10:20].view(np.float16)  # what a batch's column arrays are
    b = pool.get(1000)
    assert b is not a  # `a` is still held (through the view)
    del a
    assert id(pool.get(1000)) != a_id  # the view alone keeps it from reuse
    del view
    c = pool.get(800)
    assert id(c) == a_id  # nobody holds it any more: reused
    assert pool.get(5000).nbytes >= 5000  # too small buffers are not handed out


def test_buffer_pool_tracks_mmap_backed_buffers_through_their_views():
    import mmap

    keep = []

    def allocate(nbytes):
        mapping = mmap.mmap(-1, nbytes)
        keep.append(mapping)  # like VerbsConnection, which keeps its registered mappings
        return np.frombuffer(mapping, dtype=np.uint8)

    pool = BufferPool(allocate)
    a = pool.get(8192)
    a_id = id(a)
    column = a[100:200].view(np.uint16)  # a batch column: its .base is the mmap, not `a`
    del a
    assert id(pool.get(8192)) != a_id  # the column still views that memory
    del column
    assert id(pool.get(8192)) == a_id


def test_buffer_pool_hands_the_buffers_it_forgets_to_forget():
    forgotten = []
    pool = BufferPool(max_buffers=2, forget=forgotten.append)
    held = [pool.get(100) for _ in range(3)]  # a learner keeping its batches: the pool must grow past its size
    assert len(forgotten) == 1 and forgotten[0] is held[0]  # the oldest (the RDMA plane deregisters it)
    assert all(pool.get(100) is not b for b in held)


def test_batch_buffers_are_page_aligned():
    from gear_client.data_planes.batch import page_aligned_empty

    for n in (1, 4096, 300_000):
        assert page_aligned_empty(n).ctypes.data % 4096 == 0 and page_aligned_empty(n).nbytes == n


def test_buffer_pool_does_not_hand_out_a_buffer_a_gather_still_writes():
    pool = BufferPool()
    first = pool.get(4096)

    def gather_into(buf=first):  # what ShmPlane.start() hands its worker: the buffer only, no arrays yet
        return buf

    first_id = id(first)
    del first
    assert id(pool.get(4096)) != first_id  # the pending gather holds it
    del gather_into
    assert id(pool.get(4096)) == first_id


def test_inline_batches_spanning_several_messages_are_assembled_and_windowed():
    d = start_daemon(table_config("big", 64))
    try:
        table = d.tables["big"]
        fill(table, 30, length=64, dim=1024)  # 256 KiB items: about 8 per SampleResponse
        fill(table, 4, start=900, length=10, dim=1024)  # and some short ones
        from gear_client.data_planes.sampler import PlaneSampler

        with PlaneSampler(d.address(), "big", planes=["inline"]) as s:
            whole = s.sample(40)
            assert whole.plane == "inline" and check_batch(whole) == 40
            assert whole.columns[1].shape == (40, 64, 1024)
            windowed = s.sample(40, window=Window(12, -12, "head"))
        view = table.layout().column_view(table.segment.buffer, 1)
        for i, key in enumerate(windowed.keys.tolist()):
            slot = int(np.flatnonzero(table.meta.key == key)[0])
            n = int(table.meta.length[slot, 1])
            k = min(n, 12)
            assert np.all(windowed.columns[1][i, :12 - k] == 0)
            assert np.array_equal(windowed.columns[1][i, 12 - k:], view[slot, n - k:n])
            assert windowed.lengths[i, 1] == k
    finally:
        d.stop()


def test_inline_batches_follow_a_growing_table_without_cutting_items():
    from gear_client.data_planes.sampler import PlaneSampler
    from tests.support.trajectories import insert

    d = start_daemon(table_config("t", 4))
    try:
        table = d.tables["t"]
        insert(table, 1, length=4, dim=4)
        with PlaneSampler(d.address(), "t", planes=["inline"]) as s:
            assert s.sample(1).columns[1].shape == (1, 4, 4)  # the layout the session opened with
            insert(table, 2, length=12, dim=4)  # longer items: the table grows
            insert(table, 3, length=12, dim=4)
            batches = [s.sample(4) for _ in range(3)]
            assert all(b.plane == "inline" and check_batch(b) == 4 for b in batches)  # whole items, intact
            assert all(b.columns[1].shape == (4, 12, 4) for b in batches)
            for b in batches:
                assert [4 if key == 1 else 12 for key in b.keys.tolist()] == b.lengths[:, 1].tolist()
    finally:
        d.stop()
