"""Checkpoint files on real Tables: exact round trip, atomic layout, refusal of damaged checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.checkpoint.checkpointer import (
    COMPLETE,
    MANIFEST,
    REFUSED,
    Checkpointer,
    CheckpointError,
    CheckpointSettings,
)
from gear_server.daemon_ops import restore_table, table_state
from gear_server.storage import SegmentStore
from gear_server.table.table import ItemToInsert, Table

SHM_DIR = "/dev/shm"
OBS_ACT = pb.Structure(kind=pb.Structure.DICT, keys=["act", "obs"], children=[pb.Structure(), pb.Structure()])
NO_LIMIT = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1.7976931348623157e308,
                                 max_diff=1.7976931348623157e308)


def table_config(name: str, sampler: pb.SelectorOptions, remover: pb.SelectorOptions, max_size: int = 50,
                 max_times_sampled: int = 0) -> pb.TableConfig:
    return pb.TableConfig(name=name, sampler=sampler, remover=remover, max_size=max_size, rate_limiter=NO_LIMIT,
                          max_times_sampled=max_times_sampled)


def make_item(key: int, priority: float, length: int, episode: int):
    """{'act': int64 scalar (squeezed), 'obs': float32 [length, 3]}; values encode the key."""

    obs = np.arange(length * 3, dtype=np.float32).reshape(length, 3) + 1000 * key
    return ItemToInsert(key=key, priority=priority, structure=OBS_ACT, columns=[np.array(key, np.int64), obs],
                        squeeze=[True, False], episode_ids=frozenset({episode}))


SELECTORS = {
    "uniform": pb.SelectorOptions(uniform=True),
    "prioritized": pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.8)),
    "fifo": pb.SelectorOptions(fifo=True),
    "lifo": pb.SelectorOptions(lifo=True),
    "max_heap": pb.SelectorOptions(heap=pb.HeapOptions(min_heap=False)),
}


@pytest.fixture
def store():
    """A segment store of its own; the test must leave no segment behind."""
    s = SegmentStore(SHM_DIR, f"ops{uuid.uuid4().hex[:10]}")
    yield s
    s.close()
    leaked = [name for name in os.listdir(SHM_DIR) if name.startswith(f"gear.{s.instance}.")]
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"segments left behind: {leaked}"


def filled_tables(store) -> dict[str, Table]:
    """Tables of every selector kind with items of several lengths, some sampled, some deleted."""
    tables = {
        "prio": Table(table_config("prio", SELECTORS["prioritized"], SELECTORS["fifo"], max_size=30), store, seed=1),
        "uni": Table(table_config("uni", SELECTORS["uniform"], SELECTORS["max_heap"], max_size=20,
                                  max_times_sampled=3), store, seed=2),
        "lifo": Table(table_config("lifo", SELECTORS["lifo"], SELECTORS["fifo"], max_size=40), store, seed=3),
        "empty": Table(table_config("empty", SELECTORS["uniform"], SELECTORS["fifo"]), store, seed=4),
    }
    for name, table in tables.items():
        if name == "empty":
            continue
        for key in range(1, 36):
            table.insert(make_item(key + 100 * len(name), priority=0.5 + (key * 7) % 11, length=1 + key % 4,
                                   episode=key // 3), timeout=5)
        for _ in range(5):
            table.release(table.sample(4, timeout=5).lease_id)
    tables["prio"].mutate_priorities({135: 9.0}, [136])
    return tables


def _info(table: Table) -> pb.TableInfo:
    """TableInfo without what is measured rather than stored (call statistics and worker time, as in Reverb)."""
    info = table.info()
    info.rate_limiter_info.ClearField("insert_stats")
    info.rate_limiter_info.ClearField("sample_stats")
    info.ClearField("table_worker_time_ms")
    return info


def _probabilities(table: Table) -> dict[int, tuple[float, int]]:
    """Probability and table size reported per key over many samples."""
    out = {}
    for _ in range(20):
        selection = table.sample(3, timeout=5)
        for key, p, size in zip(selection.keys, selection.probabilities, selection.table_sizes, strict=True):
            out[int(key)] = (round(float(p), 12), int(size))
        table.release(selection.lease_id)
    return out


def next_samples(table: Table, rounds: int = 6) -> list[list[int]]:
    out = []
    for _ in range(rounds):
        selection = table.sample(3, timeout=5)
        out.append([int(k) for k in selection.keys])
        table.release(selection.lease_id)
    return out


def test_round_trip_restores_every_piece_of_state(tmp_path, store):
    tables = filled_tables(store)
    ckpt = Checkpointer(tmp_path / "ckpt")
    path = ckpt.write(table_state(t) for t in tables.values())
    assert path.name.startswith("ckpt-000001-") and (path / COMPLETE).is_file()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [path.name]  # no temporary left

    found = ckpt.load_latest()
    assert found is not None and found[0] == path
    restored = {}
    for state in found[1]:
        restored[state.config.name] = Table(state.config, store, seed=99)  # another seed: the RNG state is restored
        restore_table(restored[state.config.name], state)

    for name, table in tables.items():
        copy = restored[name]
        assert _info(copy) == _info(table), name  # sizes, deletes, episodes, unique samples
        a, b = table.snapshot(), copy.snapshot()
        assert a.arrays.keys() == b.arrays.keys()
        for key in a.arrays:
            np.testing.assert_array_equal(a.arrays[key], b.arrays[key], err_msg=f"{name}: {key}")
        assert a.scalars == b.scalars  # rate-limiter counters, sequence numbers, RNG state
        if name == "empty":
            continue
        # Remover state: inserting into the full tables evicts the same items.
        for key in range(900, 905):
            table.insert(make_item(key, 2.0, 2, 99), timeout=5)
            copy.insert(make_item(key, 2.0, 2, 99), timeout=5)
        assert sorted(copy.snapshot().arrays["keys"]) == sorted(table.snapshot().arrays["keys"]), name
        # Sampler state: every item keeps its probability; ordered selectors pick the same items.
        if name == "prio":
            before, after = _probabilities(table), _probabilities(copy)
            common = before.keys() & after.keys()
            assert len(common) >= 5 and {k: before[k] for k in common} == {k: after[k] for k in common}
        # Items back in their slots with the RNG state: the next samples are the very same items.
        assert next_samples(copy) == next_samples(table), name
    for table in [*tables.values(), *restored.values()]:
        table.close()


def test_item_bytes_survive_exactly(tmp_path, store):
    table = Table(table_config("t", SELECTORS["fifo"], SELECTORS["fifo"], max_times_sampled=1), store, seed=0)
    for key in range(1, 6):
        table.insert(make_item(key, 1.0, length=key, episode=key))
    ckpt = Checkpointer(tmp_path)
    ckpt.write([table_state(table)])
    (state,) = ckpt.load_latest()[1]
    copy = Table(state.config, store)
    restore_table(copy, state)
    selection = copy.sample(5, timeout=5)
    act, obs = copy.read(selection)
    assert act.tolist() == [1, 2, 3, 4, 5]
    expected = np.concatenate([np.arange(k * 3, dtype=np.float32).reshape(k, 3) + 1000 * k for k in range(1, 6)])
    np.testing.assert_array_equal(obs, expected)
    copy.release(selection.lease_id)
    table.close()
    copy.close()


def _two_checkpoints(tmp_path, store):
    table = Table(table_config("t", SELECTORS["uniform"], SELECTORS["fifo"]), store, seed=0)
    for key in range(1, 11):
        table.insert(make_item(key, 1.0, 2, 0))
    ckpt = Checkpointer(tmp_path, keep=5)
    old = ckpt.write([table_state(table)])
    table.insert(make_item(11, 1.0, 2, 0))
    new = ckpt.write([table_state(table)])
    table.close()
    return ckpt, old, new


def _num_items(states) -> int:
    return int(states[0].state["scalars"]["num_items"])


def _column_file(path) -> str:
    manifest = json.loads((path / MANIFEST).read_text())
    return next(name for name in manifest["files"] if name.endswith(".npy") and "column" in name and "/1" in name)


def test_corrupted_file_is_refused_and_the_previous_checkpoint_restores(tmp_path, store, caplog):
    ckpt, old, new = _two_checkpoints(tmp_path, store)
    victim = new / _column_file(new)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit pattern in the item bytes
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its SHA-256 check"):
        Checkpointer.load(new)
    with caplog.at_level(logging.ERROR, logger="gear_server.checkpoint.checkpointer"):
        path, states = ckpt.load_latest()
    assert path == old and _num_items(states) == 10
    assert f"{new}" in caplog.text and "SHA-256" in caplog.text
    assert (new / REFUSED).read_text().startswith(str(new))
    assert ckpt.complete() == [old]  # refused: neither loaded again nor counted by keep


def test_truncated_file_is_refused_with_its_sizes(tmp_path, store):
    ckpt, old, new = _two_checkpoints(tmp_path, store)
    victim = new / _column_file(new)
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 7)
    with pytest.raises(CheckpointError, match=f"has {size - 7} bytes, the manifest says {size}"):
        Checkpointer.load(new)
    assert ckpt.load_latest()[0] == old


def test_damaged_manifest_or_missing_marker_is_never_loaded(tmp_path, store):
    ckpt, old, new = _two_checkpoints(tmp_path, store)
    manifest = new / MANIFEST
    manifest.write_text(manifest.read_text().replace('"t"', '"u"', 1))
    with pytest.raises(CheckpointError, match="does not match the checksum"):
        Checkpointer.load(new)
    (old / COMPLETE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        Checkpointer.load(old)
    assert ckpt.load_latest() is None


def test_pickled_arrays_and_paths_outside_are_refused(tmp_path, store):
    ckpt, _, new = _two_checkpoints(tmp_path, store)
    name = _column_file(new)
    victim = new / name
    with open(victim, "wb") as f:  # an object array: loading it would unpickle
        np.lib.format.write_array(f, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    manifest = json.loads((new / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": victim.stat().st_size,
                               "sha256": hashlib.sha256(victim.read_bytes()).hexdigest()}
    text = json.dumps(manifest).encode()
    (new / MANIFEST).write_bytes(text)
    (new / COMPLETE).write_text(json.dumps({"manifest_sha256": hashlib.sha256(text).hexdigest()}))
    with pytest.raises(CheckpointError, match="not a valid .npy file"):
        Checkpointer.load(new)

    manifest["files"]["../../etc/passwd"] = manifest["files"].pop(name)
    manifest["tables"][0]["state"]["arrays"]["column/1"] = {"$array": "../../etc/passwd"}
    text = json.dumps(manifest).encode()
    (new / MANIFEST).write_bytes(text)
    (new / COMPLETE).write_text(json.dumps({"manifest_sha256": hashlib.sha256(text).hexdigest()}))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        Checkpointer.load(new)


def test_keep_prunes_old_and_interrupted_checkpoints(tmp_path, store):
    table = Table(table_config("t", SELECTORS["uniform"], SELECTORS["fifo"]), store, seed=0)
    table.insert(make_item(1, 1.0, 2, 0))
    ckpt = Checkpointer(tmp_path, keep=2)
    (tmp_path / ".tmp-ckpt-000007-20250101T000000Z").mkdir()  # a crashed write
    paths = [ckpt.write([table_state(table)]) for _ in range(4)]
    table.close()
    assert [int(p.name.split("-")[1]) for p in paths] == [8, 9, 10, 11]  # numbering goes past the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths[-2:])


def test_settings():
    s = CheckpointSettings.from_toml({"dir": "/var/lib/gear/checkpoints", "interval_s": 600, "keep": 2})
    assert s.interval_s == 600.0 and s.keep == 2 and s.on_stop
    for bad, match in (({"keep": 0}, "keep"), ({"interval_s": -1}, "interval_s"), ({"dir": ""}, "dir"),
                       ({"dri": "/x"}, "unknown key"), ({"on_stop": 1}, "on_stop")):
        with pytest.raises(ValueError, match=match):
            CheckpointSettings.from_toml(bad)
    merged = CheckpointSettings.effective(CheckpointSettings(), pb.ServerConfig(checkpoint_dir="/data/ckpt"))
    assert merged.dir == "/data/ckpt"


def test_fallback_is_used_only_when_the_directory_has_nothing_good(tmp_path, store):
    other, old, new = _two_checkpoints(tmp_path / "other", store)
    empty = Checkpointer(tmp_path / "mine")
    assert empty.load_latest(fallback=old)[0] == old  # one checkpoint named
    assert empty.load_latest(fallback=tmp_path / "other")[0] == new  # a checkpoint root: its newest
    assert empty.load_latest(fallback=tmp_path / "nothing-here") is None
    assert not (old / REFUSED).exists()  # someone else's checkpoints are never marked


def test_checkpoint_files_are_0600_and_directories_0700_whatever_the_umask(store, tmp_path):
    """A daemon started from a shell with umask 022 must not write checkpoints other users can read."""
    tables = filled_tables(store)
    root = tmp_path / "state" / "checkpoints"  # neither exists yet: both are created 0700
    previous = os.umask(0o022)
    try:
        checkpointer = Checkpointer(root, keep=2)
        checkpointer.create_root()
        path = checkpointer.write(table_state(t) for t in tables.values())
        checkpointer.refuse(path, "marked by the test")
    finally:
        os.umask(previous)
        for table in tables.values():
            table.close()
    files = [p for p in path.rglob("*") if p.is_file()]
    dirs = [root.parent, root, path, *(p for p in path.rglob("*") if p.is_dir())]
    assert len(files) > 10 and (path / COMPLETE) in files and (path / REFUSED) in files
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o600)}
    assert {oct(p.stat().st_mode & 0o777) for p in dirs} == {oct(0o700)}
