"""reverb.structured_writer on TrajectoryWriter: patterns, conditions, configs, priorities.

Run against the recording servicer.
"""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.writers import structured_writer as structured
from gear_contract._proto import replay_pb2 as pb
from gear_contract.specs import TensorSpec
from tests.support.recording import FakeClient

pytestmark = pytest.mark.timeout(60)

STEP = {"obs": None, "action": None, "flag": None}


@pytest.fixture
def client(server):
    c = FakeClient(server.address, {name: pb.TableInfo(name=name) for name in ("a", "b", "c", "d")})
    yield c
    c.close()


def step(i: int, flag: bool = False) -> dict:
    return {"obs": np.full(2, i, np.float32), "action": np.int64(i), "flag": np.bool_(flag)}


def by_table(server) -> dict:
    out: dict = {}
    for item in server.servicer.items:
        out.setdefault(item.table, []).append(item.data)
    return out


def test_patterns_and_conditions(server, client):
    C = structured.Condition
    configs = [
        # Every other step, the last 3 observations and the newest action (squeezed).
        structured.create_config(
            structured.pattern_from_transform(STEP, lambda s: {"obs": s["obs"][-3:], "act": s["action"][-1]}),
            "a", conditions=[C.step_index() % 2 == 0]),
        # Every 4 steps since the last item.
        structured.create_config(
            structured.pattern_from_transform(STEP, lambda s: [s["action"][-4:]]), "b",
            conditions=[C.steps_since_applied() >= 4]),
        # At the end of the episode only: the last two actions.
        structured.create_config(
            structured.pattern_from_transform(STEP, lambda s: s["action"][-2:]), "c",
            conditions=[C.is_end_episode()]),
        # When the data says so.
        structured.create_config(
            structured.pattern_from_transform(STEP, lambda s: (s["obs"][-1],)), "d",
            conditions=[C.data(STEP)["flag"] == 1]),
    ]
    with structured.StructuredWriter(client, configs) as w:
        for i in range(9):
            w.append(step(i, flag=(i == 5)))
        w.end_episode()
    got = by_table(server)
    # step_index 0 and 1 lack history for obs[-3:]; then 2, 4, 6, 8.
    assert [int(d["act"]) for d in got["a"]] == [2, 4, 6, 8]
    np.testing.assert_array_equal(got["a"][0]["obs"][:, 0], [0, 1, 2])
    assert [list(d[0]) for d in got["b"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(d) for d in got["c"]] == [[7, 8]]
    assert len(got["d"]) == 1 and got["d"][0][0].shape == (2,) and got["d"][0][0][0] == 5


def test_partial_steps_and_step_is_open(server, client):
    config = structured.create_config(structured.pattern_from_transform(
        STEP, lambda s: {"obs": s["obs"][-1], "act": s["action"][-1]}), "a")
    w = structured.StructuredWriter(client, [config])
    w.append({"obs": np.zeros(2, np.float32), "action": None, "flag": None}, partial_step=True)
    assert w.step_is_open
    w.append({"obs": None, "action": np.int64(3), "flag": np.bool_(False)})
    assert not w.step_is_open
    w.flush()
    assert int(by_table(server)["a"][0]["act"]) == 3
    with pytest.raises(ValueError, match="length"):
        w.append({"obs": None})
    w.close()


def test_missing_values_skip_the_item(server, client):
    config = structured.create_config(structured.pattern_from_transform(STEP, lambda s: s["action"][-2:]), "a")
    w = structured.StructuredWriter(client, [config])
    w.append({"obs": None, "action": None, "flag": None})
    w.append({"obs": None, "action": np.int64(1), "flag": None})  # step 0 has no action: no item
    w.append({"obs": None, "action": np.int64(2), "flag": None})
    w.flush()
    assert [list(d) for d in by_table(server)["a"]] == [[1, 2]]
    w.close()


def test_config_validation():
    ref = structured.create_reference_step(STEP)
    with pytest.raises(ValueError):
        structured.create_config({"x": ref["obs"][1]}, "a")  # indices count back from the newest step
    with pytest.raises(ValueError):
        structured.create_config({"x": ref["obs"][-2:-3]}, "a")
    with pytest.raises(TypeError):
        structured.create_config({"x": 1}, "a")
    with pytest.raises(ValueError):
        structured.StructuredWriter(object(), [])


def test_infer_signature():
    step_spec = {"obs": TensorSpec([2], np.float32), "action": TensorSpec([], np.int64), "flag": np.bool_}
    ref = structured.create_reference_step(STEP)
    c1 = structured.create_config({"obs": ref["obs"][-3:], "act": ref["action"][-1]}, "a")
    c2 = structured.create_config({"obs": ref["obs"][-2:], "act": ref["action"][-2]}, "a")
    sig = structured.infer_signature([c1, c2], step_spec)
    assert sig["obs"] == TensorSpec([None, 2], np.float32, "obs")
    assert sig["act"] == TensorSpec([], np.int64, "act")
    assert structured.infer_signature([c1], step_spec)["obs"].shape == (3, 2)
    with pytest.raises(ValueError, match="same table"):
        structured.infer_signature([c1, structured.create_config({"obs": ref["obs"][-1], "act": ref["action"][-1]},
                                                                 "b")], step_spec)
    with pytest.raises(ValueError, match="dtypes"):
        structured.infer_signature([c1, structured.create_config({"obs": ref["action"][-3:],
                                                                  "act": ref["action"][-1]}, "a")], step_spec)


def test_the_module_is_reverbs_structured_writer():
    import gear_client as reverb
    from gear_client.writers import structured_writer as sw

    assert reverb.structured_writer is sw
    for name in ("StructuredWriter", "Config", "Condition", "create_config", "create_reference_step",
                 "pattern_from_transform", "infer_signature", "unpack_pattern", "constant_priority_fn", "td_error"):
        assert hasattr(sw, name), name


def test_constant_and_td_error_priorities(server, client):
    step_structure = {"obs": None, "td": None}
    const = structured.create_config(structured.pattern_from_transform(step_structure, lambda s: s["obs"][-1]), "a",
                                     priority=structured.constant_priority_fn(2.5))
    default = structured.create_config(structured.pattern_from_transform(step_structure, lambda s: s["obs"][-1]), "c")
    td = structured.td_error(0.9, step_structure, lambda s: s["td"])
    assert td.WhichOneof("priority_fn") == "td_error" and td.td_error.flat_source_index == 1
    r2d2 = structured.create_config(structured.pattern_from_transform(
        step_structure, lambda s: {"obs": s["obs"][-3:], "td": s["td"][-3:]}), "b", priority=td)
    with structured.StructuredWriter(client, [const, r2d2, default]) as w:
        for i, err in enumerate([1.0, -4.0, 2.0, -0.5]):
            w.append({"obs": np.float32(i), "td": np.float32(err)})
    items = server.servicer.items
    assert {i.priority for i in items if i.table == "a"} == {2.5}
    assert {i.priority for i in items if i.table == "c"} == {1.0}
    got = [i.priority for i in items if i.table == "b"]
    expected = [0.9 * 4.0 + 0.1 * (1.0 + 4.0 + 2.0) / 3, 0.9 * 4.0 + 0.1 * (4.0 + 2.0 + 0.5) / 3]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_priority_functions_are_checked():
    ref = structured.create_reference_step({"obs": None, "td": None})
    with pytest.raises(ValueError, match="does not take"):  # the TD error field must be in the pattern
        structured.create_config(ref["obs"][-1], "a", priority=structured.td_error(0.5, {"obs": None, "td": None},
                                                                                   lambda s: s["td"]))
    with pytest.raises(ValueError, match="max_priority_weight"):
        structured.create_config(ref["td"][-1], "a", priority=structured.td_error(1.5, {"obs": None, "td": None},
                                                                                  lambda s: s["td"]))
    with pytest.raises(ValueError, match=">= 0"):
        structured.create_config(ref["td"][-1], "a", priority=structured.constant_priority_fn(-1.0))
    with pytest.raises(TypeError):
        structured.create_config(ref["td"][-1], "a", priority=3.0)


def test_end_episode_finishes_an_open_partial_step(server, client):
    step_structure = {"obs": None, "act": None}
    every_step = structured.create_config(structured.pattern_from_transform(
        step_structure, lambda s: {"obs": s["obs"][-1]}), "a")
    at_end = structured.create_config(structured.pattern_from_transform(
        step_structure, lambda s: s["obs"][-2:]), "b", conditions=[structured.Condition.is_end_episode()])
    w = structured.StructuredWriter(client, [every_step, at_end])
    w.append({"obs": np.int64(0), "act": np.int64(0)})
    w.append({"obs": np.int64(1), "act": None}, partial_step=True)
    assert w.step_is_open
    w.end_episode()  # Reverb finishes the step: its items are created, then the end-of-episode ones
    assert not w.step_is_open
    got = by_table(server)
    assert [int(d["obs"]) for d in got["a"]] == [0, 1]
    assert [list(d) for d in got["b"]] == [[0, 1]]
    w.append({"obs": np.int64(5), "act": np.int64(5)})  # a new episode starts clean
    w.flush()
    assert [int(d["obs"]) for d in by_table(server)["a"]] == [0, 1, 5]
    w.close()
