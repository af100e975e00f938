"""An item whose structure names a key its table's signature lacks is refused, naming the key.

Over a real daemon on loopback: raw InsertStream (INVALID_ARGUMENT), ``client.insert``
and the TrajectoryWriter (ValueError at the writer's next call), on the same-host insert
plane and on InsertStream. Nothing is inserted; an item with the signature's keys, or
one nested in other containers with the same leaves (Reverb compares flattened leaves),
still goes in.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import gear_client as reverb
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.specs import TensorSpec

pytestmark = pytest.mark.timeout(120)

SIGNATURE = {"obs": TensorSpec((None, 2), np.float32), "act": TensorSpec((None,), np.int64)}
NESTED = {"obs": {"pos": TensorSpec((None, 2), np.float32), "vel": TensorSpec((None, 2), np.float32)}}


@pytest.fixture(scope="module")
def server():
    tables = [reverb.Table.queue("signed", max_size=100, signature=SIGNATURE),
              reverb.Table.queue("nested", max_size=100, signature=NESTED)]
    with reverb.Server(tables) as srv:
        yield srv


@pytest.fixture
def client(server):
    client = reverb.Client(f"localhost:{server.port}")
    yield client
    for table in ("signed", "nested"):  # leave the queues empty for the next test
        size = client.server_info(timeout=10)[table].current_size
        if size:
            list(client.sample(table, size, emit_timesteps=False))
    client.close()


def _size(client: reverb.Client, table: str) -> int:
    return client.server_info(timeout=10)[table].current_size


def _dict_structure(*keys: str) -> pb.Structure:
    return pb.Structure(kind=pb.Structure.DICT, keys=list(keys), children=[pb.Structure() for _ in keys])


def _raw_insert(server, structure: pb.Structure) -> list[list[int]]:
    """One InsertStream request: an obs column (3 steps of 2 floats) and an act column (3 ints)."""
    obs = np.zeros((3, 2), np.float32)
    act = np.arange(3, dtype=np.int64)
    chunks = [pb.ChunkData(chunk_key=k, data=pb.Tensor(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes()),
                           episode_id=1) for k, a in ((1, act), (2, obs))]
    columns = [pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=k, length=3)]) for k in (1, 2)]  # 'act', then 'obs'
    request = pb.InsertStreamRequest(chunks=chunks, items=[
        pb.PrioritizedItem(key=77, table="signed", priority=1.0, structure=structure, columns=columns)])
    with grpc.insecure_channel(f"localhost:{server.port}") as channel:
        stub = pb_grpc.ReplayServiceStub(channel)
        return [list(r.keys) for r in stub.InsertStream(iter([request]), timeout=10)]


def test_raw_insert_stream_with_an_unknown_key_is_invalid_argument_naming_it(server, client):
    with pytest.raises(grpc.RpcError) as info:
        _raw_insert(server, _dict_structure("action", "obs"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'action'" in info.value.details() and "signature" in info.value.details(), info.value.details()
    assert _size(client, "signed") == 0
    assert _raw_insert(server, _dict_structure("act", "obs")) == [[77]]  # the signature's keys: accepted
    assert _size(client, "signed") == 1


def test_client_insert_with_an_unknown_key_is_refused_naming_it(client):
    with pytest.raises(ValueError, match=r"key 'bogus' is not in the table's signature"):
        client.insert({"obs": np.zeros(2, np.float32), "bogus": np.int64(1)}, {"signed": 1.0})
    assert _size(client, "signed") == 0
    client.insert({"obs": np.zeros(2, np.float32), "act": np.int64(1)}, {"signed": 1.0})
    assert _size(client, "signed") == 1


def test_a_nested_unknown_key_is_named_with_its_path(client):
    with pytest.raises(ValueError, match=r"key 'obs/speed' is not in the table's signature \(keys there: 'pos', "
                                         r"'vel'\)"):
        client.insert({"obs": {"pos": np.zeros(2, np.float32), "speed": np.zeros(2, np.float32)}}, {"nested": 1.0})
    assert _size(client, "nested") == 0


def test_the_same_leaves_in_other_containers_still_fit(client):
    """Reverb compares flattened leaves: a tuple (act, obs) fits the dict signature {act, obs}."""
    client.insert((np.int64(1), np.zeros(2, np.float32)), {"signed": 1.0})
    assert _size(client, "signed") == 1


@pytest.mark.parametrize("plane", ["insert_plane", "insert_stream"])
def test_a_writer_item_with_an_unknown_key_fails_the_writer_naming_it(client, monkeypatch, plane):
    if plane == "insert_stream":
        monkeypatch.setenv("GEAR_INSERT_PLANE", "0")
    with client.trajectory_writer(2) as writer:
        for i in range(2):
            writer.append({"obs": np.full(2, i, np.float32), "act": np.int64(i)})
            writer.create_item("signed", 1.0, {"obs": writer.history["obs"][-1:], "act": writer.history["act"][-1:]})
        writer.flush(timeout_ms=20_000)
        assert _size(client, "signed") == 2
        writer.append({"obs": np.full(2, 9, np.float32), "act": np.int64(9)})
        with pytest.raises(ValueError, match=r"key 'acts' is not in the table's signature"):
            writer.create_item("signed", 1.0, {"obs": writer.history["obs"][-1:],
                                               "acts": writer.history["act"][-1:]})
            writer.flush(timeout_ms=20_000)
    assert _size(client, "signed") == 2
