"""What a sample is: the item's data plus its sampling information (as Reverb)."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["SampleInfo", "ReplaySample"]


class SampleInfo(NamedTuple):
    """Per-item sampling information; plain Python int/float values.

    ``table_size`` is the size before any deletion this sample caused,
    ``times_sampled`` counts this sample, ``priority`` is the value when sampled.
    """

    key: int
    probability: float
    table_size: int
    priority: float
    times_sampled: int

    @classmethod
    def from_proto(cls, msg: Any) -> SampleInfo:
        """From a ``gear.v1.SampleInfo``."""
        return cls(int(msg.key), float(msg.probability), int(msg.table_size), float(msg.priority),
                   int(msg.times_sampled))

    @classmethod
    def tf_dtypes(cls) -> SampleInfo:
        """The dtypes of the fields (uint64, float64, int64, float64, int32), as numpy dtypes: no TensorFlow."""
        import numpy as np

        return cls(np.dtype(np.uint64), np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.float64),
                   np.dtype(np.int32))

    @classmethod
    def tf_shapes(cls) -> SampleInfo:
        """Every field is a scalar."""
        return cls((), (), (), (), ())

    @classmethod
    def zeros(cls) -> SampleInfo:
        """A SampleInfo with Python zero values for all fields."""
        return cls(0, 0.0, 0, 0.0, 0)


class ReplaySample(NamedTuple):
    """One sample: ``info`` (a SampleInfo) and ``data`` (the item's nest)."""

    info: SampleInfo
    data: Any
