"""Legacy Writer against a real gRPC server on loopback running a recording servicer."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from gear_client.writers.legacy_writer import Writer
from gear_contract._proto import replay_pb2 as pb
from tests.support.recording import FakeClient

pytestmark = pytest.mark.timeout(60)

Obs = collections.namedtuple("Obs", ["pixels", "done"])


@pytest.fixture
def client(server):
    c = FakeClient(server.address, {"t": pb.TableInfo(name="t"), "u": pb.TableInfo(name="u")})
    yield c
    c.close()


def step(i: int) -> dict:
    return {"obs": Obs(pixels=np.full(4, i, np.uint8), done=np.bool_(i % 2)), "reward": np.float32(i), "none": None}


def test_items_reference_the_last_steps_with_a_time_dimension(server, client):
    with Writer(client, max_sequence_length=3) as w:
        for i in range(5):
            w.append(step(i))
            w.create_item("t", num_timesteps=1, priority=float(i))
        w.create_item("u", num_timesteps=3, priority=9.0)
    items = server.servicer.items
    assert [it.table for it in items] == ["t"] * 5 + ["u"]
    single = items[0].data
    assert single["none"] is None and type(single["obs"]).__name__ == "Obs"
    assert single["reward"].shape == (1,) and single["obs"].pixels.shape == (1, 4)  # leading time dim of 1
    last = items[-1].data
    np.testing.assert_array_equal(last["reward"], np.float32([2, 3, 4]))
    np.testing.assert_array_equal(last["obs"].pixels, np.stack([np.full(4, i, np.uint8) for i in (2, 3, 4)]))
    np.testing.assert_array_equal(last["obs"].done, [False, True, False])
    # Each step crossed the wire once although two items cover steps 2..4.
    rows = collections.Counter()
    for c in server.servicer.chunk_messages():
        rows[c.data.dtype] += c.data.shape[0]
    assert rows["<f4"] == 5


def test_append_sequence_equals_appending_each_step(server, client):
    with Writer(client, max_sequence_length=2) as w:
        w.append_sequence([np.array([[1, 2, 3], [4, 5, 6]])])
        w.create_item("t", num_timesteps=1, priority=1.0)
        w.create_item("t", num_timesteps=2, priority=1.0)
    first, second = server.servicer.items
    np.testing.assert_array_equal(first.data[0], [[4, 5, 6]])
    np.testing.assert_array_equal(second.data[0], [[1, 2, 3], [4, 5, 6]])
    w2 = Writer(client, 2)
    with pytest.raises(ValueError, match="leading dimension"):
        w2.append_sequence([np.zeros((2, 1)), np.zeros((3, 1))])
    w2.close()


def test_argument_errors(client):
    for kwargs in ({"max_sequence_length": 0}, {"max_sequence_length": 2, "chunk_length": 3},
                   {"max_sequence_length": 2, "chunk_length": 0}, {"max_sequence_length": 2, "max_in_flight_items": 0}):
        with pytest.raises(ValueError):
            Writer(client, **kwargs)
    w = Writer(client, max_sequence_length=2)
    w.append({"a": np.int64(1)})
    with pytest.raises(ValueError, match="positive"):
        w.create_item("t", 0, 1.0)
    with pytest.raises(ValueError, match="max_sequence_length"):
        w.create_item("t", 3, 1.0)
    with pytest.raises(ValueError, match="steps appended"):
        w.create_item("t", 2, 1.0)
    with pytest.raises(ValueError, match="structure"):
        w.append({"a": np.int64(1), "b": np.int64(2)})
    with pytest.raises(ValueError, match="missing"):
        w.create_item("missing", 1, 1.0)
    w.close()
    with pytest.raises(ValueError, match="already"):
        w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.append({"a": np.int64(1)})
    with pytest.raises(ValueError, match="reuse"):
        with w:
            pass


def test_close_flushes_and_ends_the_stream(server, client):
    w = Writer(client, max_sequence_length=1, max_in_flight_items=None)
    w.append([np.zeros(2, np.float32)])
    w.create_item("t", 1, 1.0)
    w.close()
    assert len(server.servicer.items) == 1
    assert server.servicer.streams_ended == 1
    assert server.servicer.live_chunks_at_end == [0]
