"""TrajectoryWriter and the legacy Writer, as Reverb users drive them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.support.compat import BLOCKED_MS, PROMPT_S, info_of, reverb, sample_one

WAIT_MS = PROMPT_S * 1000


def test_column_wise_append_and_history_slices(client):
    with client.trajectory_writer(5) as writer:
        for t in range(5):
            writer.append({"obs": np.full(3, t, np.float32), "act": np.int64(t)})
        writer.create_item("fifo", 1.0, {
            "obs": writer.history["obs"][-3:],
            "act": writer.history["act"][-1],        # an int index: squeezed
            "pair": writer.history["act"][[0, 4]],   # a list of indices
        })
    s = sample_one(client, "fifo")
    act, obs, pair = s.data  # sorted keys
    np.testing.assert_array_equal(obs, np.repeat(np.arange(2, 5, dtype=np.float32)[:, None], 3, axis=1))
    assert act.shape == () and int(act) == 4
    assert list(pair) == [0, 4]


def test_trajectory_column_numpy_and_shape(client):
    writer = client.trajectory_writer(4)
    try:
        for t in range(4):
            writer.append({"obs": np.full((2,), t, np.int32)})
        column = writer.history["obs"][-2:]
        assert isinstance(column, reverb.TrajectoryColumn)
        assert len(column) == 2
        np.testing.assert_array_equal(column.numpy(), [[2, 2], [3, 3]])
        np.testing.assert_array_equal(writer.history["obs"][1].numpy(), [1, 1])
        np.testing.assert_array_equal(writer.history["obs"][[0, 3]].numpy(), [[0, 0], [3, 3]])
    finally:
        writer.close()


def test_history_mirrors_the_appended_structure(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"a": np.int32(1), "nested": {"b": np.float32(2.0), "c": (np.int8(3), np.int8(4))}})
        history = writer.history
        assert set(history) == {"a", "nested"}
        assert set(history["nested"]) == {"b", "c"}
        assert isinstance(history["nested"]["c"], tuple) and len(history["nested"]["c"]) == 2
        assert int(history["nested"]["c"][1][0].numpy()) == 4
    finally:
        writer.close()


def test_structure_may_grow_between_steps(client):
    with client.trajectory_writer(3) as writer:
        writer.append({"a": np.int32(0)})
        writer.append({"a": np.int32(1), "b": np.float32(10.0)})
        writer.append({"a": np.int32(2), "b": np.float32(20.0)})
        assert set(writer.history) == {"a", "b"}
        with pytest.raises(ValueError):
            writer.history["b"][-3:]  # step 0 has no "b"
        writer.create_item("fifo", 1.0, {"a": writer.history["a"][-3:], "b": writer.history["b"][-2:]})
    a, b = sample_one(client, "fifo").data
    assert list(a) == [0, 1, 2] and list(b) == [10.0, 20.0]


def test_partial_steps_fill_one_step(client):
    with client.trajectory_writer(2) as writer:
        writer.append({"obs": np.int32(1)}, partial_step=True)
        assert writer.episode_steps == 0
        writer.append({"act": np.int32(2)})
        assert writer.episode_steps == 1
        writer.create_item("fifo", 1.0, {"obs": writer.history["obs"][-1], "act": writer.history["act"][-1]})
    act, obs = sample_one(client, "fifo").data
    assert (int(obs), int(act)) == (1, 2)


def test_setting_a_field_twice_in_one_step_is_a_value_error(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"obs": np.int32(1)}, partial_step=True)
        with pytest.raises(ValueError, match="obs"):
            writer.append({"obs": np.int32(2)})
    finally:
        writer.close()


@pytest.mark.parametrize("second", [np.zeros(3, np.int64), np.zeros(4, np.float32)], ids=["dtype", "shape"])
def test_dtype_or_shape_change_in_a_column_names_the_column(client, second):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"observation": np.zeros(3, np.float32), "other": np.int32(0)})
        with pytest.raises(ValueError, match="observation"):
            writer.append({"observation": second, "other": np.int32(1)})
    finally:
        writer.close()


def test_create_item_refuses_leaves_that_are_not_columns(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"a": np.int32(1)})
        with pytest.raises(TypeError):
            writer.create_item("fifo", 1.0, {"a": np.int32(1)})
        with pytest.raises(TypeError):
            writer.create_item("fifo", 1.0, {"a": writer.history["a"][-1], "b": 3})
    finally:
        writer.close()
    assert info_of(client, "fifo").current_size == 0


def test_create_item_refuses_an_empty_trajectory(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"a": np.int32(1)})
        with pytest.raises(ValueError):
            writer.create_item("fifo", 1.0, {"a": writer.history["a"][5:5]})
        with pytest.raises(ValueError):
            writer.create_item("fifo", 1.0, [])
        writer.flush(timeout_ms=WAIT_MS)
    finally:
        writer.close()
    assert info_of(client, "fifo").current_size == 0


def test_create_item_refuses_a_nan_priority(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"a": np.int32(1)})
        with pytest.raises(ValueError):
            writer.create_item("prioritized", math.nan, {"a": writer.history["a"][-1]})
        writer.flush(timeout_ms=WAIT_MS)
    finally:
        writer.close()
    assert info_of(client, "prioritized").current_size == 0


def test_create_item_refuses_expired_references(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"a": np.int32(0)})
        old = writer.history["a"][-1:]
        for t in range(1, 4):
            writer.append({"a": np.int32(t)})
        with pytest.raises(ValueError):
            writer.create_item("fifo", 1.0, {"a": old})
        with pytest.raises(ValueError):
            writer.history["a"][-3:]  # only the 2 newest steps are kept alive
        writer.create_item("fifo", 1.0, {"a": writer.history["a"][-2:]})
        writer.flush(timeout_ms=WAIT_MS)
    finally:
        writer.close()
    assert list(sample_one(client, "fifo").data[0]) == [2, 3]


def test_create_item_refuses_an_unknown_table_naming_it(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"a": np.int32(1)})
        with pytest.raises(ValueError, match="no_such_table"):
            writer.create_item("no_such_table", 1.0, {"a": writer.history["a"][-1]})
    finally:
        writer.close()


def test_create_item_validates_against_the_table_signature(client):
    writer = client.trajectory_writer(2)
    try:
        writer.append({"obs": np.zeros(2, np.float64), "act": np.int64(0)})  # obs should be float32
        with pytest.raises(ValueError):
            writer.create_item("signed", 1.0, {"obs": writer.history["obs"][-1:], "act": writer.history["act"][-1:]})
    finally:
        writer.close()
    assert info_of(client, "signed").current_size == 0


def test_flush_and_end_episode_time_out_while_the_rate_limiter_blocks(client):
    writer = client.trajectory_writer(1)
    try:
        for value in (0, 1):
            writer.append({"x": np.int64(value)})
            writer.create_item("tiny_queue", 1.0, {"x": writer.history["x"][-1]})
        with pytest.raises(reverb.DeadlineExceededError):
            writer.flush(timeout_ms=BLOCKED_MS)
        with pytest.raises(reverb.DeadlineExceededError):
            writer.end_episode(timeout_ms=BLOCKED_MS)
        assert int(sample_one(client, "tiny_queue").data[0]) == 0
        writer.flush(timeout_ms=WAIT_MS)
        assert int(sample_one(client, "tiny_queue").data[0]) == 1
    finally:
        writer.close()


def test_flush_block_until_num_items_must_not_be_negative(client):
    writer = client.trajectory_writer(1)
    try:
        with pytest.raises(ValueError):
            writer.flush(block_until_num_items=-1)
    finally:
        writer.close()


def test_episode_steps_and_end_episode(client):
    writer = client.trajectory_writer(3)
    try:
        assert writer.episode_steps == 0
        for t in range(3):
            writer.append({"a": np.int32(t)})
        assert writer.episode_steps == 3
        writer.create_item("fifo", 1.0, {"a": writer.history["a"][-2:]})
        writer.end_episode(timeout_ms=WAIT_MS)
        assert writer.episode_steps == 0
        assert info_of(client, "fifo").current_size == 1  # end_episode flushes
        with pytest.raises(ValueError):
            writer.history["a"][-1]  # buffers were cleared
        writer.append({"a": np.int32(7)})
        writer.create_item("fifo", 1.0, {"a": writer.history["a"][-1:]})
        writer.end_episode(clear_buffers=False, timeout_ms=WAIT_MS)
        assert int(writer.history["a"][-1].numpy()) == 7
    finally:
        writer.close()
    info = info_of(client, "fifo")
    assert info.current_size == 2 and info.num_episodes == 2


def test_context_manager_flushes_on_exit(client):
    with client.trajectory_writer(2) as writer:
        writer.append({"a": np.int32(5)})
        writer.create_item("fifo", 1.0, {"a": writer.history["a"][-1]})
    assert info_of(client, "fifo").current_size == 1


def test_items_of_one_writer_can_span_tables(client):
    with client.trajectory_writer(3) as writer:
        for t in range(3):
            writer.append({"a": np.int32(t)})
            writer.create_item("fifo", 1.0, {"a": writer.history["a"][-1]})
        writer.create_item("uniform", 2.0, {"a": writer.history["a"][:]})
    assert info_of(client, "fifo").current_size == 3
    assert list(sample_one(client, "uniform").data[0]) == [0, 1, 2]


def test_configure_validates_like_reverb(client):
    writer = client.trajectory_writer(4)
    try:
        writer.append({"a": np.int32(0)})
        with pytest.raises(ValueError):
            writer.configure(("a",), num_keep_alive_refs=0, max_chunk_length=None)
        with pytest.raises(ValueError):
            writer.configure(("a",), num_keep_alive_refs=2, max_chunk_length=3)
        writer.configure(("a",), num_keep_alive_refs=2, max_chunk_length=1)
        writer.configure(("later",), num_keep_alive_refs=3, max_chunk_length=None)
    finally:
        writer.close()


def test_long_trajectories_round_trip(client):
    """More steps than any chunk: data crosses chunk boundaries intact."""
    rng = np.random.default_rng(0)
    steps = rng.standard_normal((200, 5)).astype(np.float32)
    with client.trajectory_writer(200) as writer:
        for t in range(200):
            writer.append({"x": steps[t]})
            if t % 50 == 49:
                writer.create_item("fifo", 1.0, {"x": writer.history["x"][-50:]})
        writer.create_item("uniform", 1.0, {"x": writer.history["x"][:]})
    np.testing.assert_array_equal(sample_one(client, "uniform").data[0], steps)
    got = [s.data[0] for s in client.sample("fifo", 1, emit_timesteps=False)]
    np.testing.assert_array_equal(got[0], steps[:50])


# ------------------------------------------------------------ legacy Writer ----

def test_legacy_writer_items_reference_the_newest_steps(client):
    with client.writer(max_sequence_length=3) as writer:
        for t in range(4):
            writer.append({"a": np.int64(t), "b": np.float32(t / 2)})
        writer.create_item("fifo", num_timesteps=2, priority=1.0)
        writer.append_sequence({"a": np.array([10, 11], np.int64), "b": np.array([5.0, 5.5], np.float32)})
        writer.create_item("fifo", num_timesteps=3, priority=2.0)
    first = sample_one(client, "fifo")
    assert list(first.data[0]) == [2, 3] and list(first.data[1]) == [1.0, 1.5]
    client.mutate_priorities("fifo", deletes=[first.info.key])
    second = sample_one(client, "fifo")
    assert list(second.data[0]) == [3, 10, 11] and second.info.priority == 2.0


def test_legacy_writer_validates_num_timesteps_and_close(client):
    writer = client.writer(2)
    writer.append(np.int32(1))
    with pytest.raises(ValueError):
        writer.create_item("fifo", num_timesteps=0, priority=1.0)
    writer.create_item("fifo", num_timesteps=1, priority=1.0)
    writer.close()
    with pytest.raises(ValueError):
        writer.close()
    assert info_of(client, "fifo").current_size == 1
