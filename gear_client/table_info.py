"""Reverb's TableInfo and TableWorkerTime: what ``server_info`` reports of each table."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from gear_contract import specs
from gear_contract._proto import replay_pb2 as pb
from gear_contract.specs import as_program_specs

__all__ = ["TableInfo", "TableWorkerTime"]


class TableWorkerTime(NamedTuple):
    """Time the table spent working (Reverb's TableWorkerTime)."""

    running_ms: int = 0
    sleeping_ms: int = 0


@dataclasses.dataclass
class TableInfo:
    """A table's configuration and state (Reverb's ``reverb_types.TableInfo``).

    ``signature`` is a nest of TensorSpec (None without one): ``tf.TensorSpec``
    once the program has imported TensorFlow, gear's own otherwise (gear never
    imports TensorFlow itself: it takes seconds); the option and
    rate-limiter fields are the gear.v1 messages (same field names as Reverb's).
    """

    name: str
    sampler_options: pb.SelectorOptions
    remover_options: pb.SelectorOptions
    max_size: int
    max_times_sampled: int
    rate_limiter_info: pb.RateLimiterInfo
    signature: Any
    current_size: int
    num_episodes: int
    num_deleted_episodes: int
    num_unique_samples: int
    table_worker_time: TableWorkerTime
    # gear's own: the table's GPU mirror (device, budget_bytes, rows, mirrored_items, copied_items), None without one.
    gpu_mirror: pb.GpuMirrorInfo | None = None

    @classmethod
    def from_proto(cls, proto: pb.TableInfo) -> TableInfo:
        """The TableInfo of a daemon's ``gear.v1.TableInfo`` message.

        Args:
          proto: the message, as ``server_info`` receives it.
        """
        signature = _signature(proto.signature) if proto.HasField("signature") else None
        return cls(
            name=proto.name, sampler_options=proto.sampler_options, remover_options=proto.remover_options,
            max_size=int(proto.max_size), max_times_sampled=int(proto.max_times_sampled),
            rate_limiter_info=proto.rate_limiter_info, signature=signature, current_size=int(proto.current_size),
            num_episodes=int(proto.num_episodes), num_deleted_episodes=int(proto.num_deleted_episodes),
            num_unique_samples=int(proto.num_unique_samples),
            table_worker_time=TableWorkerTime(running_ms=int(proto.table_worker_time_ms)),
            gpu_mirror=proto.gpu_mirror if proto.HasField("gpu_mirror") else None,
        )

    @classmethod
    def from_serialized_proto(cls, proto_string: bytes) -> TableInfo:
        """The TableInfo of a serialized ``gear.v1.TableInfo`` message.

        Args:
          proto_string: the message's bytes.

        Raises:
          google.protobuf.message.DecodeError: the bytes are not such a message.
        """
        return cls.from_proto(pb.TableInfo.FromString(proto_string))


def _signature(proto: pb.Signature) -> Any:
    """The signature as a nest of specs: tf.TensorSpec where the program uses TensorFlow (as Reverb's)."""
    return as_program_specs(specs.signature_from_proto(proto))
