"""The daemon's limits: how many calls it holds open and how many bytes they may buffer.

A call past a limit ends at once with RESOURCE_EXHAUSTED and a message naming
the limit and its config key (the ``[limits]`` section, see
deploy/gear-server.example.toml): never a silent wait. Counters live on the
event loop (one thread), so they need no lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gear_server.config import known_keys
from gear_server.rpc.statuses import LimitExceeded

# Items per SampleResponse a caller may ask for (as Select's num_samples); more is INVALID_ARGUMENT.
MAX_ITEMS_PER_SAMPLE_REQUEST = 1 << 20


@dataclass(frozen=True)
class LimitSettings:
    """The ``[limits]`` section (every key optional)."""

    max_streams: int = 4096  # replay calls open at once (writers, samplers, Selects, ...)
    max_health_streams: int = 256  # health and reflection calls open at once (they may need no token)
    max_stream_buffer_bytes: int = 512 << 20  # chunk bytes one InsertStream holds (not yet released)
    max_buffered_bytes: int = 4 << 30  # chunk bytes all InsertStreams hold together

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> LimitSettings:
        section = known_keys(section, cls.__dataclass_fields__, "[limits]")
        for key, value in section.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"[limits] {key} must be a positive integer, got {value!r}")
        return cls(**section)


class CallSlots:
    """Open calls of one kind, up to a limit."""

    def __init__(self, limit: int, key: str, what: str):
        self.limit = limit
        self.key = key
        self.what = what
        self.open = 0

    def take(self) -> None:
        if self.open >= self.limit:
            raise LimitExceeded(f"{self.open} {self.what} are open", self.limit, self.key)
        self.open += 1

    def give(self) -> None:
        self.open -= 1


class ByteBudget:
    """Bytes the insert streams hold, per stream and in total."""

    def __init__(self, settings: LimitSettings):
        self.per_stream = settings.max_stream_buffer_bytes
        self.total = settings.max_buffered_bytes
        self.held = 0

    def stream(self) -> StreamBytes:
        return StreamBytes(self)


class StreamBytes:
    """One insert stream's share of a ByteBudget."""

    def __init__(self, budget: ByteBudget):
        self.budget = budget
        self.held = 0

    def take(self, n: int) -> None:
        budget = self.budget
        if self.held + n > budget.per_stream:
            raise LimitExceeded(f"this insert stream would hold {self.held + n} bytes of chunks",
                                budget.per_stream, "limits.max_stream_buffer_bytes")
        if budget.held + n > budget.total:
            raise LimitExceeded(f"the insert streams would hold {budget.held + n} bytes of chunks",
                                budget.total, "limits.max_buffered_bytes")
        self.held += n
        budget.held += n

    def give(self, n: int) -> None:
        self.held -= n
        self.budget.held -= n

    def close(self) -> None:
        self.give(self.held)
