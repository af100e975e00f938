"""Server-side exception types; service.py maps each to a gRPC status."""

from __future__ import annotations


class GearServerError(Exception):
    """Base class of the daemon's own errors."""


class TableNotFoundError(GearServerError, KeyError):
    """No table of that name on this daemon (gRPC NOT_FOUND)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"Table '{self.name}' not found"


class RateLimiterTimeout(GearServerError, TimeoutError):
    """The rate limiter did not allow the call before its timeout (gRPC DEADLINE_EXCEEDED)."""


class TableClosedError(GearServerError):
    """The table was closed (daemon stopping) while the call waited or ran (gRPC CANCELLED)."""


class CallCancelled(GearServerError):
    """The caller gave up (its RPC was cancelled) while the call waited on the rate limiter (gRPC CANCELLED)."""
