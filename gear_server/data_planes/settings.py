"""The ``[data_planes]`` section: session caps, the RDMA port, the nixl plane and the TCP stream plane for learners."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gear_server.config import known_keys
from gear_server.data_planes.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_MAX_SESSIONS_PER_PEER

_RANGES = {
    "max_sessions": (1, 1 << 20),
    "max_sessions_per_peer": (1, 1 << 20),
    "rdma_port": (1, 255),
    "rdma_gid_index": (0, 65535),
    "rdma_service_level": (0, 15),
    "rdma_traffic_class": (0, 255),
    "stream_port": (0, 65535),
    "stream_connections": (1, 16),
    "stream_max_connections": (1, 1 << 16),
    "stream_stall_timeout_s": (1, 3600),
}
_BOOLS = ("rdma", "nixl", "stream", "stream_plaintext")
_HOSTS = ("rdma_device", "stream_bind", "stream_advertise")


@dataclass(frozen=True)
class DataPlaneSettings:
    """Every key optional; RDMA keys left out fall back to the GEAR_RDMA_* environment, then to probing."""

    max_sessions: int = DEFAULT_MAX_SESSIONS  # open sessions of all learners together
    max_sessions_per_peer: int = DEFAULT_MAX_SESSIONS_PER_PEER  # of one peer (certificate name or address)
    rdma: bool = True  # false: never offer RDMA, even with a device
    rdma_device: str | None = None  # e.g. "mlx5_0" (default: the first with an active port)
    rdma_port: int | None = None
    rdma_gid_index: int | None = None  # RoCE: the GID (hence IP version and VLAN) packets leave from
    rdma_service_level: int | None = None  # lossless RoCE: the SL mapped to the PFC-protected priority
    rdma_traffic_class: int | None = None  # lossless RoCE: DSCP << 2 of the lossless class
    nixl: bool = True  # false: never offer the nixl plane, even with gear[nixl] installed
    stream: bool = True  # false: never offer the TCP stream plane (remote learners read inline)
    stream_port: int = 0  # the stream listener's port (0: any free port; the learner learns it in OpenDataPlane)
    stream_bind: str | None = None  # the address it listens on (default: the control plane's bind_address)
    stream_advertise: str | None = None  # the host learners connect to (default: the one they reached gRPC on)
    stream_connections: int = 4  # parallel connections per learner session
    stream_max_connections: int = 1024  # stream connections of all learners together
    stream_stall_timeout_s: int = 30  # a learner that takes no bytes for this long loses its connection
    stream_plaintext: bool = False  # with TLS on the control plane: bulk streams in plaintext (trusted fabric)

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> DataPlaneSettings:
        section = known_keys(section, cls.__dataclass_fields__, "[data_planes]")
        for key, (low, high) in _RANGES.items():
            value = section.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"[data_planes] {key} must be an integer in [{low}, {high}], got {value!r}")
        for key in _BOOLS:
            if not isinstance(section.get(key, True), bool):
                raise ValueError(f"[data_planes] {key} must be true or false, got {section[key]!r}")
        for key in _HOSTS:
            value = section.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"[data_planes] {key} must be a non-empty string, got {value!r}")
        return cls(**section)
