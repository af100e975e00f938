"""How the daemon's RPCs end: table errors as gRPC statuses, table lookup, limits.

Caller-chosen names in messages are cut (``gear_server.errors.shorten``).

One mapping for every servicer (the replay service and the data-plane
manager), so an error means the same status whichever RPC met it
(docs/DESIGN.md lists them).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Mapping
from typing import NoReturn, TypeVar

import grpc
from grpc import aio

from gear_server.errors import CallCancelled, RateLimiterTimeout, ShmExhausted, TableClosedError, TableNotFoundError

log = logging.getLogger(__name__)

T = TypeVar("T")

# A segment that cannot be created or grown (full tmpfs, no memory): RESOURCE_EXHAUSTED.
_EXHAUSTED_ERRNOS = frozenset((errno.ENOSPC, errno.ENOMEM, errno.EFBIG))


class LimitExceeded(Exception):
    """A configured limit refuses the call (RESOURCE_EXHAUSTED); the message names the limit and its key."""

    def __init__(self, what: str, limit: int, key: str):
        super().__init__(f"{what}: the limit is {limit} (config key {key})")
        self.key = key


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a table error ends a call with (None: not a table error; let it raise)."""
    if isinstance(error, TableNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(error)
    if isinstance(error, RateLimiterTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "rate limiter timeout"
    if isinstance(error, CallCancelled):
        return grpc.StatusCode.CANCELLED, str(error)
    if isinstance(error, TableClosedError):
        return grpc.StatusCode.UNAVAILABLE, str(error) or "table closed: the daemon is stopping"
    if isinstance(error, LimitExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, ShmExhausted):
        log.warning("%s", error)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno in _EXHAUSTED_ERRNOS):
        log.warning("out of memory or shared-memory space: %s", error)
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"the daemon is out of memory: {error}"
    return None


async def abort_for(context: aio.ServicerContext, error: BaseException) -> NoReturn:
    """End the call with the status of ``error`` (re-raised when it is no table error)."""
    status = status_of(error)
    if status is None:
        raise error
    await context.abort(*status)


async def find_table(tables: Mapping[str, T], name: str, context: aio.ServicerContext) -> T:
    """The table of that name, or the call ends NOT_FOUND."""
    table = tables.get(name)
    if table is None:
        await abort_for(context, TableNotFoundError(name))
    return table


class RefusalLog:
    """Refused calls as log lines: at most ``per_minute`` a minute, then one line saying how many were left out.

    Callers choose what they send: a flood of bad requests must not flood the log.
    """

    def __init__(self, logger: logging.Logger, per_minute: int = 5):
        self.logger = logger
        self.per_minute = per_minute
        self._window = 0.0
        self._count = 0
        self._dropped = 0

    def info(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window >= 60.0:
            if self._dropped:
                self.logger.info("%d more refused calls left out of the log in the last minute", self._dropped)
            self._window, self._count, self._dropped = now, 0, 0
        if self._count < self.per_minute:
            self._count += 1
            self.logger.info(message, *args)
        else:
            self._dropped += 1
