"""ReplaySample/SampleInfo, nested data round trips and signatures from duck-typed specs."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from tests.support.compat import PROMPT_S, as_numpy_dtype, gear_only, reverb, sample_one, spec

Step = collections.namedtuple("Step", ["observation", "reward"])

NESTED_SIGNATURE = {
    "step": Step(observation=spec((None, 3), np.float32), reward=spec((None,), np.float32)),
    "pair": (spec((None,), np.int32), spec((None, 2), np.uint8)),
    "seq": [spec((None,), np.int64), spec((None,), np.bool_)],
}


@pytest.fixture(scope="module")
def nested_server():
    sel, rl = reverb.selectors, reverb.rate_limiters
    srv = reverb.Server([
        reverb.Table("nested", sel.Fifo(), sel.Fifo(), 100, rl.MinSize(1), signature=NESTED_SIGNATURE),
    ])
    yield srv
    srv.stop()


def _shape(s) -> tuple:
    shape = s.shape
    return tuple(shape.as_list()) if hasattr(shape, "as_list") else tuple(shape)


def test_replay_sample_and_sample_info_types(client):
    client.insert(np.float32(1.0), {"sampled_twice": 2.5})
    s = sample_one(client, "sampled_twice")
    assert isinstance(s, reverb.ReplaySample) and isinstance(s.info, reverb.SampleInfo)
    assert reverb.SampleInfo._fields == ("key", "probability", "table_size", "priority", "times_sampled")
    assert reverb.ReplaySample._fields == ("info", "data")
    info = s.info
    assert type(info.key) is int and type(info.table_size) is int and type(info.times_sampled) is int
    assert type(info.probability) is float and type(info.priority) is float
    assert (info.probability, info.table_size, info.priority, info.times_sampled) == (1.0, 1, 2.5, 1)
    key, probability, table_size, priority, times_sampled = info
    assert key == info.key and times_sampled == 1


def test_table_size_is_the_size_before_the_sample_deleted_anything(client):
    for i in range(3):
        client.insert(np.int64(i), {"sampled_twice": 1.0})
    sizes = [(s.info.table_size, s.info.times_sampled) for s in client.sample("sampled_twice", 4,
                                                                               emit_timesteps=False)]
    assert sizes == [(3, 1), (3, 2), (2, 1), (2, 2)]


def test_priority_is_the_value_at_sampling_time(client):
    client.insert(np.int64(0), {"fifo": 1.0})
    key = sample_one(client, "fifo").info.key
    client.mutate_priorities("fifo", updates={key: 4.0})
    s = sample_one(client, "fifo")
    assert s.info.priority == 4.0 and s.info.times_sampled == 2


def test_nested_insert_comes_back_flat_in_reverb_order(client):
    data = {
        "b": (np.int32(1), [np.float64(2.0), np.zeros((2, 2), np.uint8)]),
        "a": Step(observation=np.arange(3, dtype=np.float32), reward=np.float32(0.5)),
    }
    client.insert(data, {"fifo": 1.0})
    s = sample_one(client, "fifo")
    assert isinstance(s.data, list)
    expected = [data["a"].observation, data["a"].reward, data["b"][0], data["b"][1][0], data["b"][1][1]]
    assert len(s.data) == len(expected)
    for got, want in zip(s.data, expected, strict=True):
        assert got.dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(got, np.asarray(want)[None])


def _write_nested(client, steps: int = 3) -> dict:
    rng = np.random.default_rng(1)
    data = {
        "step": Step(observation=rng.standard_normal((steps, 3)).astype(np.float32),
                     reward=rng.standard_normal(steps).astype(np.float32)),
        "pair": (np.arange(steps, dtype=np.int32), rng.integers(0, 255, (steps, 2)).astype(np.uint8)),
        "seq": [np.arange(steps, dtype=np.int64) * 7, np.arange(steps) % 2 == 0],
    }
    with client.trajectory_writer(steps) as writer:
        for t in range(steps):
            writer.append({
                "step": Step(observation=data["step"].observation[t], reward=data["step"].reward[t]),
                "pair": (data["pair"][0][t], data["pair"][1][t]),
                "seq": [data["seq"][0][t], data["seq"][1][t]],
            })
        h = writer.history
        writer.create_item("nested", 1.0, {
            "step": Step(observation=h["step"].observation[:], reward=h["step"].reward[:]),
            "pair": (h["pair"][0][:], h["pair"][1][:]),
            "seq": [h["seq"][0][:], h["seq"][1][:]],
        })
    return data


def test_nested_structures_round_trip_through_the_signature(nested_server):
    client = reverb.Client(f"localhost:{nested_server.port}")
    data = _write_nested(client)
    s = next(client.sample("nested", 1, emit_timesteps=False, unpack_as_table_signature=True))
    got = s.data
    assert set(got) == {"step", "pair", "seq"}
    assert type(got["step"]).__name__ == "Step" and got["step"]._fields == ("observation", "reward")
    assert isinstance(got["pair"], tuple) and isinstance(got["seq"], list)
    np.testing.assert_array_equal(got["step"].observation, data["step"].observation)
    np.testing.assert_array_equal(got["step"].reward, data["step"].reward)
    for g, w in zip(list(got["pair"]) + list(got["seq"]), list(data["pair"]) + list(data["seq"]), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)

    [steps] = list(client.sample("nested", 1, unpack_as_table_signature=True))
    assert len(steps) == 3
    np.testing.assert_array_equal(steps[1].data["step"].observation, data["step"].observation[1])
    assert bool(steps[2].data["seq"][1]) is True


def test_signature_from_objects_with_shape_and_dtype(nested_server):
    client = reverb.Client(f"localhost:{nested_server.port}")
    signature = client.server_info(timeout=PROMPT_S)["nested"].signature
    assert set(signature) == {"step", "pair", "seq"}
    obs = signature["step"].observation
    assert _shape(obs) == (None, 3) and as_numpy_dtype(obs.dtype) == np.float32
    assert as_numpy_dtype(signature["pair"][1].dtype) == np.uint8
    assert _shape(signature["seq"][0]) == (None,)


@gear_only
def test_numpy_dtypes_and_gear_specs_are_signature_leaves():
    sel, rl = reverb.selectors, reverb.rate_limiters
    table = reverb.Table("t", sel.Fifo(), sel.Fifo(), 10, rl.MinSize(1),
                         signature={"a": np.dtype(np.float32), "b": reverb.specs.TensorSpec((None, 2), np.int16)})
    srv = reverb.Server([table])
    try:
        client = srv.localhost_client()
        signature = client.server_info(timeout=PROMPT_S)["t"].signature
        assert signature["a"].dtype == np.float32 and tuple(signature["a"].shape) == ()
        assert signature["b"].dtype == np.int16 and tuple(signature["b"].shape) == (None, 2)
        with client.trajectory_writer(2) as writer:
            writer.append({"a": np.float32(1.5), "b": np.ones(2, np.int16)})
            writer.create_item("t", 1.0, {"a": writer.history["a"][-1], "b": writer.history["b"][-1:]})
        s = next(client.sample("t", 1, emit_timesteps=False, unpack_as_table_signature=True))
        assert float(s.data["a"]) == 1.5 and s.data["b"].shape == (1, 2)
    finally:
        srv.stop()


def test_mismatching_structure_is_refused_by_a_signed_table(nested_server):
    client = reverb.Client(f"localhost:{nested_server.port}")
    before = client.server_info(timeout=PROMPT_S)["nested"].current_size
    writer = client.trajectory_writer(2)
    try:
        writer.append({"x": np.zeros(3, np.float32)})
        with pytest.raises(ValueError):
            writer.create_item("nested", 1.0, {"x": writer.history["x"][-1:]})
    finally:
        writer.close()
    assert client.server_info(timeout=PROMPT_S)["nested"].current_size == before
