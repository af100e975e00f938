"""The sharding pieces that need no daemon: address specs, the global split, probabilities, assembly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gear_client.sharding.assembly import assemble
from gear_client.sharding.membership import join_host_port, resolve, shard_addresses, split_host_port
from gear_client.sharding.selection import Policy, ShardWeight, globalise, selection_mass, split
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract.selectors import priority_weights
from tests.support.sampled_batches import batch_chunk, batch_part

ROOT = Path(__file__).resolve().parents[2]
PRIO = Policy("prioritized", exponent=0.5)


def test_address_specs():
    assert shard_addresses("a:1") is None  # one daemon: a plain Client
    assert shard_addresses(["a:1", " b:2"]) == ["a:1", "b:2"]
    assert shard_addresses("a:1, b:2") == ["a:1", "b:2"]
    assert shard_addresses("shards:replay.example:8000") == ["replay.example:8000"]
    for bad in ([], ["a:1", ""], [3]):
        with pytest.raises(ValueError):
            shard_addresses(bad)
    assert split_host_port("[::1]:80") == ("::1", 80)
    assert join_host_port("::1", 80) == "[::1]:80" and join_host_port("10.0.0.1", 80) == "10.0.0.1:80"
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port("nohost")
    assert "127.0.0.1:9" in resolve("localhost:9") or resolve("localhost:9") == ["localhost:9"]
    assert resolve("127.0.0.1:9") == ["127.0.0.1:9"]


def test_prioritized_split_follows_the_masses_and_falls_back_to_sizes():
    rng = np.random.default_rng(0)
    weights = [ShardWeight(0, 10, 1.0), ShardWeight(1, 10, 3.0), ShardWeight(2, 0, 0.0), ShardWeight(3, 5, 0.0)]
    totals = np.zeros(4)
    for _ in range(50):
        for s, n in split(PRIO, weights, 1000, rng).items():
            totals[s] += n
    assert totals[2] == totals[3] == 0  # empty, and no mass while others have some
    assert totals[1] / totals.sum() == pytest.approx(0.75, abs=0.01)
    zero = [ShardWeight(0, 10, 0.0), ShardWeight(1, 30, 0.0)]
    counts = split(PRIO, zero, 40000, rng)
    assert counts[1] / 40000 == pytest.approx(0.75, abs=0.01)  # every mass 0: uniform, as one table
    assert split(PRIO, [ShardWeight(0, 0)], 8, rng) == {}


def test_uniform_fifo_split_by_size_and_heaps_take_the_best_head():
    rng = np.random.default_rng(1)
    counts = split(Policy("uniform"), [ShardWeight(0, 100), ShardWeight(1, 300)], 40000, rng)
    assert counts[1] / 40000 == pytest.approx(0.75, abs=0.01)
    heads = [ShardWeight(0, 5, head=2.0), ShardWeight(1, 5, head=7.0), ShardWeight(2, 5, head=-1.0)]
    assert split(Policy("heap"), heads, 9, rng) == {1: 9}
    assert split(Policy("heap", min_heap=True), heads, 9, rng) == {2: 9}


def test_reported_probabilities_are_global():
    priorities = {0: np.array([1.0, 4.0]), 1: np.array([9.0])}
    local_mass = {0: 10.0, 1: 20.0}
    parts = {s: (p, priority_weights(p, 0.5) / local_mass[s], np.array([7] * len(p))) for s, p in priorities.items()}
    weights = {0: ShardWeight(0, 7, 10.0), 1: ShardWeight(1, 7, 20.0), 2: ShardWeight(2, 6, 30.0)}
    size, probs = globalise(PRIO, weights, parts)
    assert size == 20
    np.testing.assert_allclose(np.concatenate(probs), np.array([1.0, 2.0, 3.0]) / 60.0)
    assert selection_mass(PRIO, priorities[1], parts[1][1]) == pytest.approx(20.0)
    _, uniform = globalise(Policy("uniform"), weights, parts)
    np.testing.assert_allclose(np.concatenate(uniform), 1 / 20)


def test_assembly_shuffles_rows_pads_columns_and_keeps_rows_together():
    batch = assemble([batch_part([1, 2], 3, "shm"), batch_part([3, 4, 5], 5, "inline")], np.random.default_rng(2))
    assert sorted(batch.keys.tolist()) == [1, 2, 3, 4, 5] and batch.plane == "inline+shm"
    flag, obs = batch.columns
    assert obs.shape == (5, 5, 2)
    for i, key in enumerate(batch.keys.tolist()):
        steps = int(batch.lengths[i, 1])
        assert flag[i] == key and steps == (3 if key <= 2 else 5)
        assert np.all(obs[i, :steps] == key) and np.all(obs[i, steps:] == 0)
    with pytest.raises(ValueError, match="different structures"):
        other = batch_part([6], 3, "shm")
        other.structure = nest.structure_of([0, 0])
        assemble([batch_part([1], 3, "shm"), other], np.random.default_rng(0))


def test_three_node_example_config_loads():
    from gear_server.config import load_config

    settings = load_config(ROOT / "deploy" / "sharding" / "gear-shard.toml")
    assert [t.name for t in settings.server.tables] == ["replay"]
    assert settings.server.port == 8000


def test_policy_of_options():
    assert Policy.of(pb.SelectorOptions(prioritized=pb.PrioritizedOptions(priority_exponent=0.7))).exponent == 0.7
    assert Policy.of(pb.SelectorOptions(heap=pb.HeapOptions(min_heap=True))).min_heap
    with pytest.raises(ValueError):
        Policy.of(pb.SelectorOptions())


def test_pieces_of_several_chunks_are_assembled_in_one_pass_aligned_and_shuffled():
    """A shard whose count spans chunks gives views of them; all pieces join one batch, every row whole."""
    from gear_client.sharding.assembly import rows

    a1, a2, b = batch_chunk(100, 6, 4), batch_chunk(200, 6, 4), batch_chunk(300, 5, 7)
    pieces = [rows(a1, 2, 6), rows(a2, 0, 3), rows(b, 0, 5)]  # shard A: leftover + a new chunk; shard B: 5
    assert np.shares_memory(pieces[0].columns[1], a1.columns[1])
    positions = []
    for seed in range(8):
        batch = assemble(pieces, np.random.default_rng(seed))
        keys = batch.keys.astype(np.int64)
        assert sorted(keys.tolist()) == [102, 103, 104, 105, 200, 201, 202, 300, 301, 302, 303, 304]
        flag, obs = batch.columns
        assert obs.shape == (12, 7, 2) and flag.shape == (12,)
        np.testing.assert_array_equal(flag, keys)
        np.testing.assert_allclose(batch.probabilities, keys / 1000.0)
        np.testing.assert_array_equal(batch.table_sizes, keys * 10)
        np.testing.assert_array_equal(batch.priorities, keys * 1.0)
        np.testing.assert_array_equal(batch.times_sampled, keys)
        steps = np.where(keys >= 300, 7, 4)
        np.testing.assert_array_equal(batch.lengths[:, 1], steps)
        for i, key in enumerate(keys.tolist()):
            assert np.all(obs[i, :steps[i]] == key) and np.all(obs[i, steps[i]:] == 0)
        positions.append(tuple(np.flatnonzero(keys < 200)))
    assert len(set(positions)) > 1  # a piece does not sit at fixed rows
    assert batch.columns[1].base is None or not np.shares_memory(batch.columns[1], a1.columns[1])


def test_assembly_refuses_pieces_of_other_dtypes_naming_the_column():
    other = batch_chunk(1, 2, 4)
    other.columns[1] = other.columns[1].astype(np.float64)
    with pytest.raises(ValueError, match="column 1"):
        assemble([batch_chunk(10, 2, 4), other], np.random.default_rng(0))


def test_gpu_assembly_tasks_carried_out_on_the_host_give_the_host_batch():
    """The assembly kernel's task table (source, destination, bytes copied, row bytes; the row's tail zeroed),
    done here with memmove, yields exactly the batch the host path assembles from the same permutation."""
    import ctypes

    from gear_client.sharding.assembly import plan_rows, rows

    a, b = batch_chunk(100, 6, 4), batch_chunk(300, 5, 7)
    pieces = [rows(a, 1, 6), rows(b, 0, 5), rows(a, 0, 1)]
    want = assemble(pieces, np.random.default_rng(5))
    order = np.random.default_rng(5).permutation(11)
    sizes = [len(p) for p in pieces]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    row_bytes = [c[0].nbytes for c in want.columns]
    offsets = [0, 256 * -(-11 * row_bytes[0] // 256)]
    out = np.full(offsets[1] + 11 * row_bytes[1], 0xEE, np.uint8)  # stale bytes: the padding must be written
    held = [[np.ascontiguousarray(p.columns[c]) for p in pieces] for c in range(2)]
    sources = [[(x.ctypes.data, x[0].nbytes) for x in column] for column in held]
    tasks = plan_rows(sources, sizes, order, starts, [out.ctypes.data + o for o in offsets], row_bytes)
    assert tasks.shape == (2, 11, 4)
    for src, dst, copy, row in tasks.reshape(-1, 4).tolist():
        ctypes.memmove(dst, src, copy)
        ctypes.memset(dst + copy, 0, row - copy)
    for c, column in enumerate(want.columns):
        got = out[offsets[c]:offsets[c] + column.nbytes].view(column.dtype).reshape(column.shape)
        np.testing.assert_array_equal(got, column)


def test_host_assembly_reuses_a_buffer_only_once_its_batch_is_dropped():
    from gear_client.sharding.assembly import HostAssembly

    context = HostAssembly()
    pieces = [batch_chunk(100, 6, 4), batch_chunk(300, 5, 7)]
    held = assemble(pieces, np.random.default_rng(0), None, context)
    snapshot = [c.copy() for c in held.columns]
    second = assemble([batch_chunk(500, 6, 4), batch_chunk(700, 5, 7)], np.random.default_rng(1), None, context)
    assert not np.shares_memory(held.columns[1], second.columns[1])
    for kept, now in zip(snapshot, held.columns, strict=True):
        np.testing.assert_array_equal(kept, now)  # the batch the learner holds is never written again
    address = second.columns[1].ctypes.data
    del second
    third = assemble(pieces, np.random.default_rng(2), None, context)
    assert third.columns[1].ctypes.data == address  # dropped: its buffer serves again (no fresh pages)
    assert sorted(third.keys.tolist()) == sorted(held.keys.tolist())


def test_global_probabilities_and_size_replace_the_pieces_own_row_for_row():
    from gear_client.sharding.assembly import rows

    a, b = batch_chunk(100, 6, 4), batch_chunk(300, 5, 7)
    pieces = [rows(a, 1, 6), b]
    flat = np.concatenate([p.keys for p in pieces]).astype(np.int64)
    batch = assemble(pieces, np.random.default_rng(4), probabilities=flat / 7.0, table_size=77)
    np.testing.assert_allclose(batch.probabilities, batch.keys.astype(np.int64) / 7.0)
    assert set(batch.table_sizes.tolist()) == {77}
    single = assemble([batch_chunk(500, 3, 4)], np.random.default_rng(0), probabilities=np.full(3, 0.25), table_size=9)
    assert single.probabilities.tolist() == [0.25] * 3 and single.table_sizes.tolist() == [9] * 3


def test_gpu_assembly_plan_refuses_a_piece_wider_than_the_batch_row():
    from gear_client.sharding.assembly import plan_rows

    with pytest.raises(ValueError, match="column 1: a piece's rows \\(96 bytes\\) exceed the batch's \\(64\\)"):
        plan_rows([[(0, 8), (0, 8)], [(0, 64), (0, 96)]], [2, 3], np.arange(5), np.array([0, 2]), [0, 4096],
                  [8, 64])


def test_picks_that_remove_their_items_never_ask_a_shard_for_more_than_it_holds():
    rng = np.random.default_rng(3)
    sizes = [ShardWeight(0, 1, 50.0), ShardWeight(1, 4, 1.0), ShardWeight(2, 2, 1.0, head=9.0)]
    for kind in ("uniform", "fifo", "prioritized"):
        policy = Policy(kind, exponent=1.0, consumes=True)
        for n in range(1, 8):
            counts = split(policy, sizes, n, rng)
            assert sum(counts.values()) == n
            assert all(counts[w.shard] <= w.size for w in sizes if w.shard in counts), (kind, n, counts)
    # past the table's size every item is taken; the rest waits where it was drawn
    over = split(Policy("uniform", consumes=True), sizes, 10, rng)
    assert sum(over.values()) == 10 and all(over[w.shard] >= w.size for w in sizes)
    # uniform without replacement: each item equally likely to be in the batch
    hits = np.zeros(3)
    for _ in range(3000):
        for shard, c in split(Policy("uniform", consumes=True), sizes, 3, rng).items():
            hits[shard] += c
    assert np.allclose(hits / hits.sum(), [1 / 7, 4 / 7, 2 / 7], atol=0.02)
    # a heap that removes: the best heads first, each shard's content at most
    heads = [ShardWeight(0, 2, head=5.0), ShardWeight(1, 3, head=9.0), ShardWeight(2, 4, head=1.0)]
    assert split(Policy("heap", consumes=True), heads, 4, rng) == {1: 3, 0: 1}
    assert split(Policy("heap", min_heap=True, consumes=True), heads, 5, rng) == {2: 4, 0: 1}
