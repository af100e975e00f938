"""One table over three real daemon processes: global sampling, routing, failure, checkpoints, planes."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

import gear_client as reverb
from gear_client.sharding.client import ShardedClient
from gear_contract.selectors import priority_weights
from tests.support.shard_cluster import EXPONENT, ITEM_DIM, ITEM_STEPS, NUM_SHARDS, Cluster
from tests.support.statistics import P_MIN, chi_square_p
from tests.support.trajectories import ACTION, item_ok, make_item

pytestmark = pytest.mark.timeout(120)

SIZES = (4, 9, 15)  # items per shard in "prio", "uni" and "heap": different sizes and masses
SEED = 20261125


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("shards"))
    try:
        _fill(c)
        yield c
    finally:
        c.stop()


def _priority(item_id: int) -> float:
    return 0.5 + (item_id * 7919 % 23) / 4.0


def _fill(c: Cluster) -> None:
    """Item ids 0.. in shard order; each shard's items go straight to its daemon."""
    item_id = 0
    for shard, n in enumerate(SIZES):
        client = reverb.Client(c.addresses[shard])
        for _ in range(n):
            p = _priority(item_id)
            client.insert({"id": np.int64(item_id)}, priorities={"prio": p, "uni": 1.0, "heap": p})
            item_id += 1
        client.close()


def _ids(batch) -> np.ndarray:
    return np.asarray(batch.columns[0]).reshape(len(batch), -1)[:, 0].astype(np.int64)


def _reset_and_close(clients: list, table: str) -> None:
    """Empty ``table`` through each of ``clients`` (one per shard) and close them."""
    for client in clients:
        client.reset(table)
        client.close()


def _sharded(c: Cluster, **kwargs) -> ShardedClient:
    client = reverb.Client(c.addresses, **kwargs)
    assert isinstance(client, ShardedClient)
    return client


def test_one_address_is_a_plain_client_and_addresses_of_one_daemon_are_one_shard(cluster):
    assert type(reverb.Client(cluster.addresses[0])) is reverb.Client
    client = reverb.Client([f"localhost:{cluster.ports[0]}", cluster.addresses[0], cluster.addresses[1]])
    try:
        shards = [s.address for s in client.shards()]  # localhost and 127.0.0.1 reach one daemon: one shard
        assert shards[0] in (f"localhost:{cluster.ports[0]}", cluster.addresses[0])
        assert shards[1:] == [cluster.addresses[1]]
        assert isinstance(reverb.Client(",".join(cluster.addresses)), ShardedClient)
    finally:
        client.close()


def test_server_info_reports_global_size_and_counters(cluster):
    client = _sharded(cluster)
    try:
        info = client.server_info()
        total = sum(SIZES)
        assert info["prio"].current_size == total
        assert info["uni"].max_size == NUM_SHARDS * 1000
        assert info["prio"].rate_limiter_info.insert_stats.completed >= total
        assert [s.up for s in info["prio"].shards] == [True] * NUM_SHARDS
    finally:
        client.close()


def _distribution(client: ShardedClient, table: str, draws: int) -> tuple[np.ndarray, list]:
    sampler = client.sampler(table)
    counts = np.zeros(sum(SIZES))
    batches = []
    for _ in range(draws // 500):
        batch = sampler.sample(500)
        np.add.at(counts, _ids(batch), 1)
        batches.append(batch)
    return counts, batches


def test_prioritized_matches_one_table(cluster):
    client = _sharded(cluster, seed=SEED)
    try:
        counts, batches = _distribution(client, "prio", 12000)
        weights = priority_weights(np.array([_priority(i) for i in range(sum(SIZES))]), EXPONENT)
        expected = weights / weights.sum()
        assert chi_square_p(counts, expected * counts.sum()) >= P_MIN
        for batch in batches[:3]:
            np.testing.assert_allclose(batch.probabilities, expected[_ids(batch)], rtol=1e-9)
            assert set(batch.table_sizes.tolist()) == {sum(SIZES)}
        assert sorted(client.sampler("prio").kinds().values()) == ["inline", "inline", "shm"]
    finally:
        client.close()


def test_read_ahead_streams_match_one_table_too(cluster):
    """batches() (what datasets read ahead through) cuts batches from every shard's stream of picks."""
    client = _sharded(cluster, seed=SEED)
    sampler = client.sampler("prio")
    stream = sampler.batches(500)
    try:
        counts = np.zeros(sum(SIZES))
        weights = priority_weights(np.array([_priority(i) for i in range(sum(SIZES))]), EXPONENT)
        expected = weights / weights.sum()
        for _ in range(24):
            batch = next(stream)
            assert len(batch) == 500
            np.add.at(counts, _ids(batch), 1)
            np.testing.assert_allclose(batch.probabilities, expected[_ids(batch)], rtol=1e-9)
        assert chi_square_p(counts, expected * counts.sum()) >= P_MIN
        assert len(sampler.kinds()) == NUM_SHARDS
    finally:
        stream.close()
        client.close()


def test_read_ahead_batch_is_one_copy_of_every_shards_pieces(cluster, monkeypatch):
    """A shard whose count spans several chunks of its stream is not assembled on its own first: each
    group of batches is one assembly of all pieces (views of the chunks), rows lined up with keys and infos."""
    from gear_client.sharding import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "STREAM_CHUNK_BATCHES", 1)  # chunks of a batch: counts span chunks
    calls = []
    real = sampler_module.assemble

    def counting(pieces, *args, **kwargs):
        calls.append([len(p) for p in pieces])
        return real(pieces, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "assemble", counting)
    client = _sharded(cluster, seed=SEED)
    stream = client.sampler("uni").batches(60)  # streams of 60-item chunks; shard 2 takes ~32 a batch
    try:
        ids_of_key: dict[int, int] = {}
        for _ in range(8):
            batch = next(stream)
            ids = _ids(batch)
            assert len(batch) == 60 and set(batch.table_sizes.tolist()) == {sum(SIZES)}
            np.testing.assert_allclose(batch.probabilities, 1.0 / sum(SIZES))
            for key, item in zip(batch.keys.tolist(), ids.tolist(), strict=True):
                assert ids_of_key.setdefault(key, item) == item  # a row's key and data belong together
    finally:
        stream.close()
        client.close()
    # one assembly per group of batches (cut from it), nothing before it
    per_group = min(sampler_module.STREAM_GROUP_BATCHES, sampler_module.STREAM_GROUP_ITEMS // 60)
    assert per_group > 1 and len(calls) == -(-8 // per_group) and all(sum(c) == 60 * per_group for c in calls)
    assert max(len(c) for c in calls) > NUM_SHARDS  # some shard gave pieces of several chunks


def test_streams_select_small_items_many_batches_at_a_time(cluster, monkeypatch):
    """Each Select of a stream picks up to STREAM_CHUNK_BATCHES batches' worth of its shard's share (small items:
    the fixed cost of a Select is paid once for many batches); the batches still come out whole and intact."""
    from gear_client.data_planes.sampler import PlaneSampler
    from gear_client.sharding import sampler as sampler_module
    from gear_client.sharding.streams import STREAM_CHUNK_BYTES, chunk_items

    asked = []
    real = PlaneSampler.batches

    def recording(self, num_samples, **kwargs):
        asked.append(num_samples)
        return real(self, num_samples, **kwargs)

    monkeypatch.setattr(PlaneSampler, "batches", recording)
    client = _sharded(cluster, seed=SEED)
    stream = client.sampler("uni").batches(30)
    try:
        ids_of_key: dict[int, int] = {}
        for _ in range(6):
            batch = next(stream)
            assert len(batch) == 30 and set(batch.table_sizes.tolist()) == {sum(SIZES)}
            for key, item in zip(batch.keys.tolist(), _ids(batch).tolist(), strict=True):
                assert ids_of_key.setdefault(key, item) == item  # a row's key and data belong together
    finally:
        stream.close()
        client.close()
    most = -(-sampler_module.STREAM_CHUNK_BATCHES * 30 // NUM_SHARDS)
    assert asked and set(asked) == {most}  # the shm plane knows the items' size: chunks of the most
    assert chunk_items(30, most, 0) == 30  # size unknown (inline): a batch a Select, as before
    assert chunk_items(30, most, STREAM_CHUNK_BYTES // 40) == 40  # big items: bounded by bytes
    assert chunk_items(30, most, STREAM_CHUNK_BYTES) == 30  # never under a batch


def test_uniform_matches_one_table_and_keys_are_unique(cluster):
    client = _sharded(cluster, seed=SEED)
    try:
        counts, batches = _distribution(client, "uni", 6000)
        total = sum(SIZES)
        assert chi_square_p(counts, np.full(total, counts.sum() / total)) >= P_MIN
        key_to_id: dict[int, int] = {}
        for batch in batches:
            np.testing.assert_allclose(batch.probabilities, 1.0 / total)
            for key, item in zip(batch.keys.tolist(), _ids(batch).tolist(), strict=True):
                assert key_to_id.setdefault(key, item) == item, "one key names two items"
        assert len(key_to_id) == total == len(set(key_to_id.values()))
        # a seeded run splits its batches alike: the same number of items from each shard
        again = _sharded(cluster, seed=SEED)
        _, replay = _distribution(again, "uni", 1000)
        again.close()
        bounds = np.cumsum(SIZES)
        for first, second in zip(batches[:2], replay, strict=True):
            assert np.array_equal(np.bincount(np.searchsorted(bounds, _ids(first), side="right"), minlength=3),
                                  np.bincount(np.searchsorted(bounds, _ids(second), side="right"), minlength=3))
    finally:
        client.close()


def test_heap_takes_the_global_head(cluster):
    client = _sharded(cluster)
    try:
        batch = client.sampler("heap").sample(5)
        best = max(range(sum(SIZES)), key=lambda i: (_priority(i), -i))
        assert _ids(batch).tolist() == [best] * 5
    finally:
        client.close()


def _masses(c: Cluster, table: str) -> list[tuple[int, float]]:
    out = []
    for address in c.addresses:
        info = reverb.Client(address)._fetch_server_info(5.0)
        t = next(t for t in info.table_info if t.name == table)
        out.append((int(t.current_size), float(t.selection_state.priority_mass)))
    return out


def test_mutate_and_delete_reach_the_owning_shard(cluster):
    client = _sharded(cluster, seed=1)
    try:
        batch = client.sampler("prio").sample(40)
        ids = _ids(batch)
        owner_of = np.searchsorted(np.cumsum(SIZES), ids, side="right")
        pick = int(np.flatnonzero(owner_of == 2)[0])
        key, item = int(batch.keys[pick]), int(ids[pick])
        before = _masses(cluster, "prio")
        client.mutate_priorities("prio", updates={key: 50.0})
        after = _masses(cluster, "prio")
        grown = 50.0 ** EXPONENT - _priority(item) ** EXPONENT
        assert after[0] == before[0] and after[1] == before[1]
        assert after[2][1] == pytest.approx(before[2][1] + grown)
        # a client that never saw the key (no cached owner) sends it to every shard: only the owner holds it
        other = _sharded(cluster)
        other.mutate_priorities("prio", updates={key: _priority(item)})
        restored = _masses(cluster, "prio")
        assert [n for n, _ in restored] == [n for n, _ in before]
        assert [m for _, m in restored] == pytest.approx([m for _, m in before])
        other.close()
        # delete through the owner cache, then put the item back where it was
        client.mutate_priorities("uni", deletes=[int(k) for k in client.sampler("uni").sample(1).keys])
        sizes = [s for s, _ in _masses(cluster, "uni")]
        assert sum(sizes) == sum(SIZES) - 1 and sorted(np.array(SIZES) - sizes) == [0, 0, 1]
    finally:
        client.close()
    _refill_uni(cluster)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5])
def test_mutate_with_a_key_that_is_not_one_names_it_and_changes_nothing(cluster, bad):
    client = _sharded(cluster, seed=1)
    try:
        key = int(client.sampler("prio").sample(1).keys[0])  # a known owner too
        before = _masses(cluster, "prio")
        with pytest.raises(ValueError, match=str(bad)):
            client.mutate_priorities("prio", updates={key: 50.0, bad: 1.0})
        with pytest.raises(ValueError, match=str(bad)):
            client.mutate_priorities("prio", deletes=[bad])
        assert _masses(cluster, "prio") == before
    finally:
        client.close()


@pytest.mark.parametrize(("bad", "says"), [(float("nan"), "is NaN"), (-2.0, "is negative"),
                                           (float("inf"), "must be finite")])
def test_mutate_with_a_bad_priority_is_one_daemons_value_error_and_changes_nothing(cluster, bad, says):
    client = _sharded(cluster, seed=1)
    try:
        key = int(client.sampler("prio").sample(1).keys[0])
        before = _masses(cluster, "prio")
        with pytest.raises(ValueError, match=f"new priority of key 7 {says}"):
            client.mutate_priorities("prio", updates={key: 50.0, 7: bad})
        assert _masses(cluster, "prio") == before
    finally:
        client.close()


def _refill_uni(c: Cluster) -> None:
    """Give "uni" back one item on the shard that lost one (ids as before)."""
    sizes = [s for s, _ in _masses(c, "uni")]
    for shard, (have, want) in enumerate(zip(sizes, SIZES, strict=True)):
        if have < want:
            present = set()
            client = reverb.Client(c.addresses[shard])
            for s in client.sample("uni", 200, emit_timesteps=False):
                present.add(int(np.asarray(s.data[0]).reshape(-1)[0]))
            lo = sum(SIZES[:shard])
            missing = sorted(set(range(lo, lo + want)) - present)
            for item in missing:
                client.insert({"id": np.int64(item)}, priorities={"uni": 1.0})
            client.close()


def test_inserts_go_to_the_own_host_daemon_else_spread_by_writer(cluster):
    own = _sharded(cluster)  # this process's host identity is shard 0's
    other = _sharded(cluster, host_id="elsewhere", seed=3)
    try:
        before = [s for s, _ in _masses(cluster, "events")]
        for i in range(3):
            own.insert({"id": np.int64(1000 + i)}, priorities={"events": 1.0})
        after = [s for s, _ in _masses(cluster, "events")]
        assert after[0] == before[0] + 3 and after[1:] == before[1:]
        own.reset("events")
        for i in range(12):
            with other.trajectory_writer(2) as writer:
                writer.append({"id": np.int64(2000 + i)})
                writer.create_item("events", 1.0, {"id": writer.history["id"][-1]})
        spread = [s for s, _ in _masses(cluster, "events")]
        assert sum(spread) == 12 and all(s > 0 for s in spread)
        other.reset("events")
        assert other.server_info()["events"].current_size == 0
    finally:
        own.close()
        other.close()


def _write_items(client, stop: threading.Event, first: int) -> None:
    seed = first
    while not stop.is_set():
        item = make_item(seed, ITEM_STEPS, ITEM_DIM)
        with client.trajectory_writer(ITEM_STEPS) as writer:
            for t in range(ITEM_STEPS):
                writer.append({k: v[t] for k, v in item.items()})
            writer.create_item("items", 1.0, {k: writer.history[k][-ITEM_STEPS:] for k in item})
        seed += 1


def test_learner_reads_own_shard_over_shm_others_over_streams_never_torn(cluster):
    addresses = cluster.addresses
    writers = [reverb.Client(a) for a in addresses]
    stop = threading.Event()
    threads = [threading.Thread(target=_write_items, args=(w, stop, 10_000 * (i + 1)), daemon=True)
               for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    try:
        with reverb.TrajectoryDataset(addresses, "items", batch_size=16, max_samples=16 * 25,
                                      sampler_options={"seed": SEED}) as ds:
            seen = 0
            seed_of_key: dict[int, int] = {}
            for batch in ds.batches():
                action, obs, reward = batch.columns
                for i in range(len(batch)):  # checksums: no item mixes bytes of two
                    n = int(batch.lengths[i, ACTION])
                    assert n == ITEM_STEPS and item_ok(action[i, :n], obs[i, :n], reward[i, :n]), f"item {i} torn"
                    assert seed_of_key.setdefault(int(batch.keys[i]), int(action[i, 0])) == int(action[i, 0])
                seen += len(batch)
                assert set(batch.table_sizes.tolist()) <= set(range(1, NUM_SHARDS * 24 + 1))
            assert seen == 16 * 25
            kinds = ds._sampler.kinds()
            assert kinds[addresses[0]] == "shm"
            assert kinds[addresses[1]] == kinds[addresses[2]] == "stream"  # remote shards: TCP streams
            assert ds.plane == "shm+stream"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for w in writers:
            w.close()


def test_dead_shard_is_skipped_marked_and_rejoins_with_its_checkpoint(cluster, caplog):
    client = _sharded(cluster, host_id="elsewhere", seed=SEED, shard_timeout_s=1.0, shard_retry_s=0.2)
    try:
        paths = client.checkpoint().split(",")
        assert len(paths) == NUM_SHARDS
        client.sampler("uni").sample(8)  # sessions open on every shard
        cluster.kill(2)
        with caplog.at_level(logging.WARNING, logger="gear_client.sharding"):
            batch = client.sampler("uni").sample(300)
        assert len(batch) == 300
        ids = _ids(batch)
        assert ids.max() < sum(SIZES[:2]), "a dead shard's items were sampled"
        assert set(batch.table_sizes.tolist()) == {sum(SIZES[:2])}
        assert any("is down" in r.getMessage() for r in caplog.records)
        states = client.server_info()["uni"].shards
        assert [s.up for s in states] == [True, True, False] and states[2].failures == 1
        for i in range(6):  # inserts meant for it go to the others
            client.insert({"id": np.int64(5000 + i)}, priorities={"events": 1.0})
        assert client.server_info()["events"].current_size == 6
        cluster.restart(2)  # restores the checkpoint taken above
        for _ in range(100):
            if client.shards()[2].up:
                break
            threading.Event().wait(0.1)
        assert client.shards()[2].up
        batch = client.sampler("uni").sample(600)
        assert _ids(batch).max() >= sum(SIZES[:2]), "the restarted shard's items are not sampled"
        assert set(batch.table_sizes.tolist()) == {sum(SIZES)}
    finally:
        client.close()
        if not cluster.alive(2):
            cluster.restart(2)
        for address in cluster.addresses:
            reverb.Client(address).reset("events")


def test_checkpoint_and_restore_every_shard(cluster):
    client = _sharded(cluster)
    try:
        before = {name: info.current_size for name, info in client.server_info().items()}
        paths = client.checkpoint().split(",")
        assert len(paths) == NUM_SHARDS and len(set(paths)) == NUM_SHARDS
    finally:
        client.close()
    for i in range(NUM_SHARDS):
        cluster.daemons[i].stop()
    for i in range(NUM_SHARDS):
        cluster.restart(i)
    client = _sharded(cluster)
    try:
        after = {name: info.current_size for name, info in client.server_info().items()}
        assert after == before
        assert after["prio"] == sum(SIZES)
    finally:
        client.close()


def test_a_part_waiting_on_a_hung_shard_is_taken_from_the_others(cluster, caplog):
    """Every shard's limiter holds its part; shard 2 then hangs (SIGSTOP): after the shard timeout its part
    is split again over the others, which deliver once inserts let them; shard 2 rejoins after SIGCONT."""
    direct = [reverb.Client(a) for a in cluster.addresses]
    for shard, client in enumerate(direct):
        client.insert({"id": np.int64(100 * shard)}, priorities={"gate": 1.0})
    sharded = _sharded(cluster, host_id="elsewhere", seed=SEED, shard_timeout_s=1.0, shard_retry_s=0.3)
    result: dict = {}

    def sample() -> None:
        try:
            result["batch"] = sharded.sampler("gate").sample(24, timeout=60)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    waiter = threading.Thread(target=sample, daemon=True)
    try:
        waiter.start()
        threading.Event().wait(1.0)  # the parts take what the limiters allow (3 a shard), then wait
        assert waiter.is_alive()
        with caplog.at_level(logging.WARNING, logger="gear_client.sharding"):
            cluster.pause(2, True)
            deadline = threading.Event()
            for _ in range(50):
                if not sharded.shard_set.shards[2].up:
                    break
                deadline.wait(0.1)
            assert not sharded.shard_set.shards[2].up, "the hung shard was not noticed"
            for shard in (0, 1):
                for j in range(1, 31):  # enough for the whole batch on either shard
                    direct[shard].insert({"id": np.int64(100 * shard + j)}, priorities={"gate": 1.0})
            waiter.join(30)
        assert "error" not in result, result.get("error")
        batch = result["batch"]
        assert len(batch) == 24
        assert all(i < 200 for i in _ids(batch).tolist()), "items of the hung shard were delivered"
        assert sharded.sampler("gate").resplits >= 1
        assert any("is down" in r.getMessage() for r in caplog.records)
        cluster.pause(2, False)
        for _ in range(100):
            if sharded.shards()[2].up:
                break
            threading.Event().wait(0.1)
        assert sharded.shards()[2].up
    finally:
        cluster.pause(2, False)
        sharded.close()
        _reset_and_close(direct, "gate")


def test_a_queue_over_shards_takes_what_each_shard_holds(cluster):
    """Picks that remove their items (a queue): a batch as large as the table comes out whole and at once,
    each shard asked for no more than it holds (a part asked for more would wait holding what the others
    removed); one item a shard, three times over (any split by size alone asks some shard for two)."""
    direct = [reverb.Client(a) for a in cluster.addresses]
    client = _sharded(cluster, seed=SEED)
    try:
        for round_ in range(3):
            for shard, c in enumerate(direct):
                c.insert({"id": np.int64(1000 * round_ + shard)}, priorities={"queue": 1.0})
            batch = client.sampler("queue").sample(NUM_SHARDS, timeout=10)
            assert sorted(_ids(batch).tolist()) == [1000 * round_ + s for s in range(NUM_SHARDS)]
            assert [c.server_info()["queue"].current_size for c in direct] == [0] * NUM_SHARDS
    finally:
        client.close()
        _reset_and_close(direct, "queue")


def test_checkpoint_and_reset_do_not_hang_on_a_hung_shard(cluster):
    """A shard that holds its connections but answers nothing (SIGSTOP): checkpoint() and reset() end after
    about twice the shard timeout with a ServiceError naming it, the others' work done and the shard down."""
    direct = [reverb.Client(a) for a in cluster.addresses]
    for shard, c in enumerate(direct):
        c.insert({"id": np.int64(7000 + shard)}, priorities={"events": 1.0})
    client = _sharded(cluster, shard_timeout_s=1.0, shard_retry_s=0.3)
    try:
        client.server_info()  # every shard up and connected
        cluster.pause(1, True)
        for call in (client.checkpoint, lambda: client.reset("events")):
            start = time.monotonic()
            with pytest.raises(reverb.errors.ServiceError, match=cluster.addresses[1]):
                call()
            assert time.monotonic() - start < 10.0  # a hung call waited forever
        assert not client.shards()[1].up
        assert [direct[i].server_info()["events"].current_size for i in (0, 2)] == [0, 0]
        start = time.monotonic()  # known down now: named at once, no call (and no pool thread) left on it
        with pytest.raises(reverb.errors.ServiceError, match=f"{cluster.addresses[1]} \\(down"):
            client.checkpoint()
        assert time.monotonic() - start < 1.0
    finally:
        cluster.pause(1, False)
        client.close()
        _reset_and_close(direct, "events")


def test_an_address_down_at_start_is_a_down_shard_with_a_warning_and_its_cause(cluster, caplog):
    from tests.support.ports import free_port

    nobody = f"127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="gear_client.sharding"):
        client = reverb.Client([*cluster.addresses, nobody], shard_timeout_s=0.5)
    try:
        state = client.shards()[-1]
        assert state.address == nobody and not state.up and state.failures == 1
        assert "UNAVAILABLE" in state.last_error, state.last_error  # the reason, not the wait's deadline
        assert any(nobody in r.getMessage() and "does not answer" in r.getMessage() for r in caplog.records)
        assert [s.up for s in client.server_info()["uni"].shards] == [True] * NUM_SHARDS + [False]
    finally:
        client.close()


def test_sampling_past_a_hung_shard_waits_one_shard_timeout(cluster):
    """A shard that stops answering (SIGSTOP) while its session is open: the next batch comes from the
    others after about ``shard_timeout_s`` (its mass query times out), not after its session's close too."""
    client = _sharded(cluster, seed=SEED, shard_timeout_s=1.0, shard_retry_s=0.3)
    try:
        sampler = client.sampler("uni")
        sampler.sample(64)  # a data-plane session open on shard 0 (this host's: shm)
        assert sampler.kinds()[cluster.addresses[0]] == "shm"
        cluster.pause(0, True)
        start = time.monotonic()
        batch = sampler.sample(8)
        assert time.monotonic() - start < 4.0  # the session's close alone waited 5 s
        assert len(batch) == 8 and not client.shards()[0].up
        assert _ids(batch).min() >= SIZES[0], "the hung shard's items were sampled"
    finally:
        cluster.pause(0, False)
        client.close()


def _daemons(tmp_path, tables: list[str]) -> tuple[list, list[str]]:
    """One daemon per table text (TOML of its [[tables]]), started; (processes, addresses)."""
    from tests.support.daemon_process import DaemonProcess

    daemons = []
    for i, table in enumerate(tables):
        config = f'bind_address = "127.0.0.1"\nport = 0\ninstance_name = "extra{os.getpid()}s{i}"\n{table}'
        daemons.append(DaemonProcess(tmp_path, config, name=f"extra{i}"))
    return daemons, [f"127.0.0.1:{d.wait_ready()}" for d in daemons]


def test_read_ahead_held_by_a_shards_min_size_ends_at_the_timeout(tmp_path):
    """MinSize(5) on each shard, 5 items on one and 2 on the other: the second holds its part, so read-ahead
    batches asked with a 1 s timeout end with DeadlineExceededError after about 1 s, not the shard timeout."""
    table = '[[tables]]\nname = "m"\nsampler = "uniform"\nremover = "fifo"\nmax_size = 10\n' \
            'rate_limiter = { min_size = 5 }\n'
    daemons, addresses = _daemons(tmp_path, [table, table])
    try:
        for address, n in zip(addresses, (5, 2), strict=True):
            direct = reverb.Client(address)
            for i in range(n):
                direct.insert({"id": np.int64(i)}, priorities={"m": 1.0})
        client = reverb.Client(addresses, shard_timeout_s=15.0)
        try:
            batches = client.sampler("m").batches(64, timeout=1.0)
            start = time.monotonic()
            with pytest.raises(reverb.errors.DeadlineExceededError):
                next(batches)
            assert time.monotonic() - start < 10.0  # the shard timeout is 15 s
            batches.close()
        finally:
            client.close()
    finally:
        for d in daemons:
            d.stop()


def test_a_table_configured_differently_on_a_shard_is_refused_by_name(tmp_path):
    """Two daemons whose table "t" differs (item shape 3 against 4): the sharded sampler refuses it with a
    ValueError naming the odd shard at its first split, before any batch could mix the two."""
    tables = [f'[[tables]]\nname = "t"\nsampler = "uniform"\nremover = "fifo"\nmax_size = 10\n'
              f'rate_limiter = {{ min_size = 1 }}\n[tables.signature]\nx = {{ dtype = "float32", shape = [{w}] }}\n'
              for w in (3, 4)]
    daemons, addresses = _daemons(tmp_path, tables)
    try:
        client = reverb.Client(addresses)
        try:
            with pytest.raises(ValueError, match=f"configured differently on shard {addresses[1]}"):
                client.sampler("t").sample(1, timeout=5)
        finally:
            client.close()
    finally:
        for d in daemons:
            d.stop()


def test_client_sample_of_a_sharded_queue_takes_one_item_per_next(cluster):
    """As one daemon's ``Client.sample``: a table whose picks remove items is sampled one item a call, so a
    ``next()`` takes one item of the whole table and the rest stay."""
    direct = [reverb.Client(a) for a in cluster.addresses]
    client = _sharded(cluster, seed=SEED)
    try:
        for shard, c in enumerate(direct):
            for i in range(3):
                c.insert({"id": np.int64(100 * shard + i)}, priorities={"queue": 1.0})
        samples = client.sample("queue", num_samples=6, emit_timesteps=False)
        next(samples)
        assert sum(c.server_info()["queue"].current_size for c in direct) == 3 * NUM_SHARDS - 1
        del samples
    finally:
        client.close()
        _reset_and_close(direct, "queue")
