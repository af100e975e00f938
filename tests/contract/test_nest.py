"""nest: flatten order, wire round trips (no pickle), namedtuples rebuilt by name."""

from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest

from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb

Point = collections.namedtuple("Point", ["x", "y"])


def test_flatten_sorts_dict_keys_depth_first():
    data = {"b": [1, (2, 3)], "a": {"z": 4, "c": 5}}
    assert nest.flatten(data) == [5, 4, 1, 2, 3]


def test_none_is_an_empty_node():
    assert nest.flatten({"a": None, "b": 1}) == [1]
    assert nest.flatten(None) == []
    s = nest.structure_of({"a": None, "b": 1})
    assert nest.unflatten(s, [7]) == {"a": None, "b": 7}


def test_single_leaf_round_trip():
    s = nest.structure_of(np.zeros(3))
    assert s.kind == pb.Structure.LEAF
    assert nest.unflatten(s, ["x"]) == "x"


def test_wire_round_trip_keeps_container_types():
    data = {"obs": [np.float32(1), (2, 3)], "info": Point(x=4, y={"k": 5}), "none": None}
    s = nest.structure_of(data)
    wire = pb.Structure.FromString(s.SerializeToString())
    rebuilt = nest.unflatten(wire, nest.flatten(data))
    assert rebuilt == data
    assert type(rebuilt["obs"]) is list and type(rebuilt["obs"][1]) is tuple
    assert type(rebuilt["info"]) is Point  # the class this process knows


def test_unknown_namedtuple_is_created_with_same_name_and_fields():
    s = pb.Structure(kind=pb.Structure.NAMEDTUPLE, type_name="Transition", keys=["obs", "reward"],
                     children=[pb.Structure(), pb.Structure()])
    t = nest.unflatten(s, [1, 2])
    assert type(t).__name__ == "Transition"
    assert t._fields == ("obs", "reward")
    assert (t.obs, t.reward) == (1, 2)
    # The same wire type gives the same class every time.
    assert type(nest.unflatten(s, [3, 4])) is type(t)


def test_structure_carries_no_pickle():
    s = nest.structure_of({"p": Point(1, 2)})
    raw = s.SerializeToString()
    assert b"Point" in raw
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises, it is not a pickle
        pickle.loads(raw)


def test_unflatten_checks_leaf_count():
    s = nest.structure_of({"a": 1, "b": 2})
    with pytest.raises(ValueError, match="2 leaves"):
        nest.unflatten(s, [1])


def test_malformed_structure_is_a_value_error():
    s = pb.Structure(kind=pb.Structure.DICT, keys=["a", "b"], children=[pb.Structure()])
    with pytest.raises(ValueError, match="malformed"):
        nest.unflatten(s, [1])


def test_non_string_keys_cannot_cross_the_wire():
    assert nest.flatten({2: "b", 1: "a"}) == ["a", "b"]
    with pytest.raises(TypeError, match="str"):
        nest.structure_of({1: "a"})


def test_pack_as_and_map_structure():
    ref = {"a": Point(1, 2), "b": [3]}
    assert nest.pack_as(ref, [10, 20, 30]) == {"a": Point(10, 20), "b": [30]}
    assert nest.map_structure(lambda x, y: x + y, ref, ref) == {"a": Point(2, 4), "b": [6]}
    with pytest.raises(ValueError):
        nest.pack_as(ref, [1, 2])


def test_assert_same_structure():
    nest.assert_same_structure({"a": [1, 2]}, {"a": [3, 4]})
    with pytest.raises(ValueError, match="keys"):
        nest.assert_same_structure({"a": 1}, {"b": 1})
    with pytest.raises(ValueError, match="length"):
        nest.assert_same_structure([1, 2], [1])
    with pytest.raises(ValueError):
        nest.assert_same_structure([1], (1,))
    nest.assert_same_structure([1], (1,), check_types=False)


def test_flatten_with_paths_and_treedef():
    data = {"a": [1, None], "b": Point(2, 3)}
    assert nest.flatten_with_paths(data) == [(("a", 0), 1), (("b", 0), 2), (("b", 1), 3)]
    assert nest.flatten_with_paths(data, none_is_leaf=True)[1] == (("a", 1), None)
    leaves, t1 = nest.flatten_with_treedef(data)
    assert leaves == [1, 2, 3]
    _, t2 = nest.flatten_with_treedef({"b": Point(9, 9), "a": [0, None]})
    _, t3 = nest.flatten_with_treedef({"a": [1, None], "b": (2, 3)})
    assert t1 == t2 and t1 != t3
    assert hash(t1) == hash(t2)
