"""What a sample is: the item's data plus its sampling information (as Reverb)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb

__all__ = ["SampleInfo", "ReplaySample", "emit_sample"]


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
        """From a ``gear.v1.SampleInfo``.

        Args:
          msg: the message (or any object with its five fields).
        """
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


def emit_sample(info: SampleInfo, data: list, structure: pb.Structure | None, emit_timesteps: bool
                ) -> list[ReplaySample] | ReplaySample:
    """What ``sample`` yields for one item: its ReplaySample, or one per step (``emit_timesteps``).

    Args:
      info: the item's sampling information.
      data: the item's columns, flat, each ``[steps, *shape]``.
      structure: the nest to unpack ``data`` into (None: keep the flat list).
      emit_timesteps: split the item into one ReplaySample per step.

    Raises:
      ValueError: ``emit_timesteps`` with columns of different lengths or without a time dimension.
    """
    if emit_timesteps:
        if len({_length_of(col) for col in data}) != 1:
            raise ValueError("Can't split non timestep trajectory into timesteps.")
        steps = []
        for t in range(_length_of(data[0])):
            step = [np.asarray(col[t], col.dtype) for col in data]
            steps.append(ReplaySample(info=info, data=_unpack(structure, step)))
        return steps
    return ReplaySample(info=info, data=_unpack(structure, data))


def _length_of(column: np.ndarray) -> int:
    if column.ndim == 0:
        raise ValueError("Can't split non timestep trajectory into timesteps.")
    return int(column.shape[0])


def _unpack(structure: pb.Structure | None, leaves: list) -> Any:
    if structure is None:
        return leaves
    return nest.unflatten(structure, leaves)
