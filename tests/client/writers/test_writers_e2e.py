"""Writers end to end: a real daemon (gear_client.Server), write, then sample and compare."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gear_client as reverb
from gear_contract.specs import TensorSpec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    tables = [
        reverb.Table.queue("queue", max_size=1000),
        reverb.Table.queue("legacy", max_size=10),
        reverb.Table.queue("recover", max_size=10),
        reverb.Table.queue("structured", max_size=10),
        reverb.Table.queue("small", max_size=2),
        reverb.Table("typed", sampler=reverb.selectors.Fifo(), remover=reverb.selectors.Fifo(), max_size=100,
                     rate_limiter=reverb.rate_limiters.MinSize(1),
                     signature={"obs": TensorSpec([None, 4], np.float32), "action": TensorSpec([], np.int64)}),
    ]
    srv = reverb.Server(tables=tables, port=None)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = reverb.Client(f"localhost:{server.port}")
    for table in ("queue", "legacy", "recover", "structured", "small", "typed"):
        c.reset(table)
    return c


def step(i: int) -> dict:
    return {"obs": np.full(4, i, np.float32), "action": np.int64(i), "reward": np.float32(i / 2)}


def test_trajectories_written_are_sampled_back(client):
    length, steps = 5, 30
    expected = []
    with client.trajectory_writer(num_keep_alive_refs=length) as writer:
        for i in range(steps):
            writer.append(step(i))
            if writer.episode_steps >= length:
                trajectory = {"obs": writer.history["obs"][-length:], "action": writer.history["action"][-1],
                              "reward": writer.history["reward"][-length:]}
                writer.create_item("queue", priority=1.0, trajectory=trajectory)
                expected.append(i)
        assert writer._stream._raw  # hand-encoded bytes on the client's channel
        writer.end_episode()
    assert client.server_info()["queue"].current_size == len(expected)
    for last, sample in zip(expected, client.sample("queue", len(expected), emit_timesteps=False), strict=True):
        action, obs, reward = sample.data  # flat: the table has no signature (sorted keys)
        window = np.arange(last - length + 1, last + 1)
        assert action.shape == () and int(action) == last
        np.testing.assert_array_equal(obs, np.repeat(window.astype(np.float32)[:, None], 4, axis=1))
        np.testing.assert_array_equal(reward, (window / 2).astype(np.float32))
        assert sample.info.priority == 1.0 and isinstance(sample.info.key, int)


def test_legacy_writer_round_trip(client):
    with client.writer(max_sequence_length=3) as writer:
        for i in range(4):
            writer.append(step(i))
        writer.create_item("legacy", num_timesteps=3, priority=2.0)
    (sample,) = list(client.sample("legacy", 1, emit_timesteps=False))
    action, obs, reward = sample.data
    np.testing.assert_array_equal(action, [1, 2, 3])
    assert obs.shape == (3, 4) and reward.dtype == np.float32
    assert sample.info.priority == 2.0


def test_signature_mismatch_and_unknown_table_are_value_errors(client):
    with client.trajectory_writer(num_keep_alive_refs=3) as writer:
        for i in range(3):
            writer.append(step(i))
        h = writer.history
        with pytest.raises(ValueError, match="typed"):
            writer.create_item("typed", 1.0, {"obs": h["obs"][:], "action": h["reward"][-1]})
        with pytest.raises(ValueError, match="no_such_table"):
            writer.create_item("no_such_table", 1.0, {"obs": h["obs"][:]})
        writer.create_item("typed", 1.0, {"obs": h["obs"][:], "action": h["action"][-1]})
    (sample,) = list(client.sample("typed", 1, emit_timesteps=False, unpack_as_table_signature=True))
    assert int(sample.data["action"]) == 2
    np.testing.assert_array_equal(sample.data["obs"][:, 0], [0, 1, 2])


def test_unknown_table_without_client_validation_fails_on_the_server(client):
    writer = client.trajectory_writer(num_keep_alive_refs=2, validate_items=False)
    writer.append(step(0))
    writer.create_item("no_such_table", 1.0, writer.history["obs"][:])
    with pytest.raises(ValueError, match="no_such_table"):
        writer.flush(timeout_ms=10_000)
    # The writer goes on with a fresh stream.
    writer.create_item("recover", 1.0, writer.history["obs"][:])
    writer.flush(timeout_ms=10_000)
    writer.close()
    assert client.server_info()["recover"].current_size == 1


def test_rate_limiter_back_pressure_reaches_the_writer(client):
    writer = client.trajectory_writer(num_keep_alive_refs=2)
    for i in range(3):
        writer.append(step(i))
        writer.create_item("small", 1.0, writer.history["action"][-1])
    # Queue of 2: the third insert waits for a sample.
    with pytest.raises(reverb.DeadlineExceededError):
        writer.flush(timeout_ms=300)
    got = []
    reader = threading.Thread(target=lambda: got.extend(client.sample("small", 1, emit_timesteps=False)))
    reader.start()
    reader.join(30)
    writer.flush(timeout_ms=10_000)
    writer.close()
    assert [int(s.data[0]) for s in got] == [0]
    assert client.server_info()["small"].current_size == 2


def test_structured_writer_round_trip(client):
    step_structure = {"obs": None, "action": None, "reward": None}
    pattern = reverb.structured.pattern_from_transform(
        step_structure, lambda s: {"obs": s["obs"][-2:], "action": s["action"][-1]})
    config = reverb.structured.create_config(pattern, "structured",
                                             conditions=[reverb.structured.Condition.step_index() % 2 == 1])
    with client.structured_writer([config]) as writer:
        for i in range(6):
            writer.append(step(i))
        writer.end_episode()
    samples = list(client.sample("structured", 3, emit_timesteps=False))
    assert [int(s.data[0]) for s in samples] == [1, 3, 5]  # flat, sorted keys: action, obs
    np.testing.assert_array_equal(samples[1].data[1][:, 0], [2, 3])
