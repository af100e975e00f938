"""The ``[ingest]`` section of the daemon's config: the insert plane and the ingest workers.

::

    [ingest]
    workers = 4                        # ingest worker processes serving InsertStream (0: none)
    bind_address = "[::]"              # where the workers listen (default: the daemon's bind address)
    insert_plane = true                # same-host writers may fill slots themselves (InsertPlane RPC)
    reservation_timeout_s = 60.0       # a reserved slot not committed within this is given back
    max_reservations_per_stream = 256  # slots one writer's stream may hold reserved
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gear_server.config import known_keys

MAX_WORKERS = 256


@dataclass
class IngestSettings:
    workers: int = 0
    bind_address: str | None = None
    insert_plane: bool = True
    reservation_timeout_s: float = 60.0
    max_reservations_per_stream: int = 256

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> IngestSettings:
        """Parse and check the section; ValueError names the key."""
        section = known_keys(section, set(cls.__dataclass_fields__), "[ingest]")
        settings = cls()
        if "workers" in section:
            settings.workers = _int(section["workers"], "workers")
        if "bind_address" in section:
            if not isinstance(section["bind_address"], str) or not section["bind_address"]:
                raise ValueError(f"[ingest] bind_address must be a non-empty string, got {section['bind_address']!r}")
            settings.bind_address = section["bind_address"]
        if "insert_plane" in section:
            if not isinstance(section["insert_plane"], bool):
                raise ValueError(f"[ingest] insert_plane must be true or false, got {section['insert_plane']!r}")
            settings.insert_plane = section["insert_plane"]
        if "reservation_timeout_s" in section:
            value = section["reservation_timeout_s"]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"[ingest] reservation_timeout_s must be a number, got {value!r}")
            settings.reservation_timeout_s = float(value)
        if "max_reservations_per_stream" in section:
            settings.max_reservations_per_stream = _int(section["max_reservations_per_stream"],
                                                        "max_reservations_per_stream")
        settings.check()
        return settings

    def check(self) -> None:
        if not 0 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"[ingest] workers must be in [0, {MAX_WORKERS}], got {self.workers}")
        if not self.reservation_timeout_s > 0:
            raise ValueError(f"[ingest] reservation_timeout_s must be > 0, got {self.reservation_timeout_s}")
        if self.max_reservations_per_stream < 1:
            raise ValueError("[ingest] max_reservations_per_stream must be >= 1, got "
                             f"{self.max_reservations_per_stream}")
        if self.workers and not self.insert_plane:
            raise ValueError("[ingest] workers write through the insert plane: set insert_plane = true")


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"[ingest] {key} must be an integer, got {value!r}")
    return value
