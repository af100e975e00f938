"""Tensor specs and table signatures without TensorFlow.

Reverb takes ``tf.TensorSpec`` nests as table signatures. gear takes its own
:class:`TensorSpec`, any object with ``.shape`` and ``.dtype`` (tf.TensorSpec,
numpy arrays, jax/torch specs...: duck-typed, TensorFlow is never imported),
and numpy dtypes (a scalar of that dtype). On the wire a signature is a
``gear.v1.Signature``: the nest structure plus one spec per leaf, an unknown
dimension written as -1.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb

__all__ = [
    "TensorSpec",
    "to_numpy_dtype",
    "to_shape",
    "to_tensor_spec",
    "spec_to_proto",
    "spec_from_proto",
    "signature_to_proto",
    "signature_from_proto",
    "signature_specs",
    "dtype_to_str",
    "kernel_dtype_name",
    "kernel_shape_text",
    "shape_compatible",
    "specs_of",
]

Shape = tuple  # tuple[int | None, ...]


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a numpy dtype/type/string or a tf.DType (``.as_numpy_dtype``)."""
    if isinstance(dtype, np.dtype):
        return dtype
    as_numpy = getattr(dtype, "as_numpy_dtype", None)
    if as_numpy is not None:  # tf.DType
        dtype = as_numpy() if callable(as_numpy) and not isinstance(as_numpy, type) else as_numpy
    try:
        out = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"cannot interpret {dtype!r} as a dtype") from e
    if out.hasobject:
        raise TypeError(f"object dtypes cannot travel as raw buffers: {dtype!r}")
    return out


def dtype_to_str(dtype: np.dtype) -> str:
    """The wire form of a dtype ('<f4', '|b1', ...): numpy's ``dtype.str``."""
    return np.dtype(dtype).str


def to_shape(shape: Any) -> Shape:
    """A tuple of int-or-None from a tuple/list, a tf.TensorShape or a torch.Size.

    Unknown rank (``TensorShape(None)``) is refused: a signature fixes the rank.
    """
    if shape is None:
        raise ValueError("a spec needs a known rank (shape=None is unknown)")
    if hasattr(shape, "rank") and hasattr(shape, "as_list"):  # tf.TensorShape
        if shape.rank is None:
            raise ValueError(f"a spec needs a known rank, got {shape!r}")
        shape = shape.as_list()
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    out = []
    for d in shape:
        value = getattr(d, "value", d)  # TF1 Dimension
        if value is None:
            out.append(None)
            continue
        value = int(value)
        if value < 0:
            if value != -1:
                raise ValueError(f"invalid dimension {value} in shape {tuple(shape)!r}")
            out.append(None)
        else:
            out.append(value)
    return tuple(out)


class TensorSpec:
    """Shape (None for an unknown dimension), numpy dtype and optional name of one leaf."""

    __slots__ = ("_shape", "_dtype", "_name")

    def __init__(self, shape: Any, dtype: Any, name: str | None = None):
        self._shape = to_shape(shape)
        self._dtype = to_numpy_dtype(dtype)
        self._name = name or None

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def name(self) -> str | None:
        return self._name

    @classmethod
    def from_spec(cls, spec: Any, name: str | None = None) -> TensorSpec:
        """Convert any spec-like object (see :func:`to_tensor_spec`)."""
        return to_tensor_spec(spec, name=name)

    @classmethod
    def from_array(cls, array: Any, name: str | None = None) -> TensorSpec:
        a = np.asarray(array)
        return cls(a.shape, a.dtype, name)

    def is_compatible_with(self, other: Any) -> bool:
        """True when ``other`` (a spec or an array) has this dtype and a matching shape."""
        other_shape = to_shape(other.shape) if hasattr(other, "shape") else np.shape(other)
        other_dtype = to_numpy_dtype(other.dtype) if hasattr(other, "dtype") else np.asarray(other).dtype
        return other_dtype == self._dtype and shape_compatible(self._shape, other_shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorSpec):
            return NotImplemented
        return (self._shape, self._dtype, self._name) == (other._shape, other._dtype, other._name)

    def __hash__(self) -> int:
        return hash((self._shape, self._dtype.str, self._name))

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self._shape}, dtype={self._dtype.name}, name={self._name!r})"


def shape_compatible(expected: Sequence[int | None], actual: Sequence[int | None]) -> bool:
    """True when the ranks match and every known dimension of both agrees."""
    if len(expected) != len(actual):
        return False
    return all(e is None or a is None or e == a for e, a in zip(expected, actual, strict=True))


def to_tensor_spec(spec: Any, name: str | None = None) -> TensorSpec:
    """A :class:`TensorSpec` from a spec-like object or a numpy dtype (a scalar spec)."""
    if isinstance(spec, TensorSpec):
        if name is None or name == spec.name:
            return spec
        return TensorSpec(spec.shape, spec.dtype, name)
    if not isinstance(spec, (type, np.dtype, str)) and hasattr(spec, "shape") and hasattr(spec, "dtype"):
        own_name = getattr(spec, "name", None)
        if not isinstance(own_name, str):
            own_name = None
        return TensorSpec(spec.shape, spec.dtype, name if name is not None else own_name)
    try:
        dtype = to_numpy_dtype(spec)
    except TypeError as e:
        raise TypeError(f"not a spec (needs .shape and .dtype, or a dtype): {spec!r}") from e
    return TensorSpec((), dtype, name)


def spec_to_proto(spec: Any) -> pb.TensorSpec:
    s = to_tensor_spec(spec)
    return pb.TensorSpec(
        name=s.name or "", dtype=dtype_to_str(s.dtype), shape=[-1 if d is None else d for d in s.shape]
    )


def spec_from_proto(msg: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(tuple(None if d < 0 else d for d in msg.shape), np.dtype(msg.dtype), msg.name or None)


def _is_spec_leaf(x: Any) -> bool:
    return not nest.is_nested(x)


def signature_to_proto(signature: Any) -> pb.Signature:
    """The wire form of a nest of specs (or dtypes)."""
    leaves = nest.flatten(signature)
    if not leaves:
        raise ValueError("a signature needs at least one spec")
    return pb.Signature(structure=nest.structure_of(signature), leaves=[spec_to_proto(s) for s in leaves])


def signature_from_proto(msg: pb.Signature) -> Any:
    """A nest of :class:`TensorSpec` from the wire form."""
    specs = [spec_from_proto(s) for s in msg.leaves]
    return nest.unflatten(msg.structure, specs)


def signature_specs(msg: pb.Signature) -> list[TensorSpec]:
    """The flat specs of a wire signature (one per leaf, in flatten order)."""
    return [spec_from_proto(s) for s in msg.leaves]


def specs_of(values: Iterable[Any]) -> list[TensorSpec]:
    """Specs of arrays (or anything numpy can convert)."""
    return [TensorSpec.from_array(v) for v in values]


# TensorFlow's C++ names of dtypes, as Reverb's error messages print them (others: NumPy's name).
_KERNEL_DTYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half"}


def kernel_dtype_name(dtype: Any) -> str:
    """A dtype as Reverb's errors name it (TensorFlow's kernel names: float, double, int64...)."""
    name = to_numpy_dtype(dtype).name
    return _KERNEL_DTYPE_NAMES.get(name, name)


def kernel_shape_text(shape: Any) -> str:
    """A shape as Reverb's errors print it: ``[3,3]``, ``[?,3]``, ``[]``; ``<unknown>`` for an unknown rank."""
    if shape is None or getattr(shape, "rank", 0) is None:
        return "<unknown>"
    return "[" + ",".join("?" if d is None else str(d) for d in to_shape(shape)) + "]"


def as_tf_spec(spec: Any, tf: Any) -> Any:
    """A ``tf.TensorSpec`` of the given TensorFlow module for any spec gear takes (gear's, TensorFlow's, a dtype)."""
    if isinstance(spec, tf.TensorSpec):
        return spec
    s = to_tensor_spec(spec)
    return tf.TensorSpec(shape=list(s.shape), dtype=tf.as_dtype(s.dtype), name=s.name)


def as_program_specs(signature: Any) -> Any:
    """``signature`` with tf.TensorSpec leaves where the program has imported TensorFlow (Reverb returns
    those, and code compares them with ``tf.TensorSpec(...)``); as it is otherwise (TensorFlow is not loaded
    for it)."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return signature
    return nest.map_structure(lambda spec: as_tf_spec(spec, tf), signature)
