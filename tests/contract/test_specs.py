"""specs: TensorSpec, duck-typed specs (tf.TensorSpec-like), signatures on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from gear_contract import specs
from gear_contract._proto import replay_pb2 as pb


class FakeTFDType:
    """Looks like tf.DType: exposes the numpy type as ``as_numpy_dtype``."""

    def __init__(self, np_type):
        self.as_numpy_dtype = np_type


class FakeTensorShape:
    """Looks like tf.TensorShape: ``rank`` and ``as_list()`` with None dimensions."""

    def __init__(self, dims):
        self._dims = dims
        self.rank = None if dims is None else len(dims)

    def as_list(self):
        if self._dims is None:
            raise ValueError("as_list() is not defined on an unknown TensorShape.")
        return list(self._dims)


class FakeTFSpec:
    def __init__(self, dims, dtype, name=None):
        self.shape = FakeTensorShape(dims)
        self.dtype = FakeTFDType(dtype)
        self.name = name


def test_tensor_spec_basics():
    s = specs.TensorSpec([None, 3], np.float32, "obs")
    assert s.shape == (None, 3) and s.dtype == np.float32 and s.name == "obs"
    assert s == specs.TensorSpec((-1, 3), "float32", "obs")
    assert s != specs.TensorSpec((2, 3), np.float32, "obs")
    assert s.is_compatible_with(np.zeros((5, 3), np.float32))
    assert not s.is_compatible_with(np.zeros((5, 4), np.float32))
    assert not s.is_compatible_with(np.zeros((5, 3), np.float64))


def test_duck_typed_tf_spec_is_converted():
    s = specs.to_tensor_spec(FakeTFSpec([None, 84, 84], np.uint8, "frames"))
    assert s == specs.TensorSpec((None, 84, 84), np.uint8, "frames")


def test_unknown_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):
        specs.to_tensor_spec(FakeTFSpec(None, np.float32))


def test_numpy_dtypes_are_scalar_specs():
    assert specs.to_tensor_spec(np.int64) == specs.TensorSpec((), np.int64)
    assert specs.to_tensor_spec(np.dtype("float16")) == specs.TensorSpec((), np.float16)


def test_not_a_spec_is_a_type_error():
    with pytest.raises(TypeError):
        specs.to_tensor_spec(object())
    with pytest.raises(TypeError, match="object"):
        specs.TensorSpec((), object)


def test_signature_round_trip_with_unknown_dims():
    signature = {"obs": FakeTFSpec([None, 4], np.float32), "action": np.int64,
                 "extras": (specs.TensorSpec([2], np.bool_, "mask"),)}
    msg = specs.signature_to_proto(signature)
    wire = pb.Signature.FromString(msg.SerializeToString())
    assert [list(leaf.shape) for leaf in wire.leaves] == [[], [2], [-1, 4]]
    back = specs.signature_from_proto(wire)
    assert back == {"obs": specs.TensorSpec((None, 4), np.float32), "action": specs.TensorSpec((), np.int64),
                    "extras": (specs.TensorSpec((2,), np.bool_, "mask"),)}
    assert [s.dtype for s in specs.signature_specs(wire)] == [np.int64, np.bool_, np.float32]


def test_empty_signature_is_refused():
    with pytest.raises(ValueError):
        specs.signature_to_proto({})


def test_shape_compatible():
    assert specs.shape_compatible((None, 3), (7, 3))
    assert not specs.shape_compatible((None, 3), (7, 3, 1))
    assert not specs.shape_compatible((2, 3), (7, 3))
