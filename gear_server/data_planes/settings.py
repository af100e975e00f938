"""The ``[data_planes]`` section: session caps and the RDMA port the daemon serves learners on."""

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
}


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

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> DataPlaneSettings:
        section = known_keys(section, cls.__dataclass_fields__, "[data_planes]")
        for key, (low, high) in _RANGES.items():
            value = section.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"[data_planes] {key} must be an integer in [{low}, {high}], got {value!r}")
        if not isinstance(section.get("rdma", True), bool):
            raise ValueError(f"[data_planes] rdma must be true or false, got {section['rdma']!r}")
        device = section.get("rdma_device")
        if device is not None and (not isinstance(device, str) or not device):
            raise ValueError(f"[data_planes] rdma_device must be a device name, got {device!r}")
        return cls(**section)
