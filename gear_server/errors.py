"""Server-side exception types; service.py maps each to a gRPC status."""

from __future__ import annotations

import errno

# Characters of a caller-chosen name (a table name) echoed in an error message. gRPC
# carries the message in the trailing metadata, whose size is limited: a message
# echoing a 10,000-character name would turn NOT_FOUND into RESOURCE_EXHAUSTED.
MAX_ECHOED_NAME_CHARS = 128


def shorten(name: str, limit: int = MAX_ECHOED_NAME_CHARS) -> str:
    """``name`` as an error message may quote it: cut to ``limit`` characters, saying how long it was."""
    if len(name) <= limit:
        return name
    return f"{name[:limit]}... ({len(name)} characters)"


class GearServerError(Exception):
    """Base class of the daemon's own errors."""


class TableNotFoundError(GearServerError, KeyError):
    """No table of that name on this daemon (gRPC NOT_FOUND)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"Table '{shorten(self.name)}' not found"


class RateLimiterTimeout(GearServerError, TimeoutError):
    """The rate limiter did not allow the call before its timeout (gRPC DEADLINE_EXCEEDED)."""


class TableClosedError(GearServerError):
    """The table was closed (daemon stopping) while the call waited or ran (gRPC CANCELLED)."""


class CheckpointConfigConflict(GearServerError):
    """The checkpoint to restore was written with table settings that cannot change under its items
    (the daemon refuses to start: exit 2, a configuration error)."""


class SamplingStopped(TableClosedError):
    """The daemon is stopping: the table takes no more samples (gRPC UNAVAILABLE; nothing was taken)."""


class CallCancelled(GearServerError):
    """The caller gave up (its RPC was cancelled) while the call waited on the rate limiter (gRPC CANCELLED)."""


class ShmExhausted(GearServerError, OSError):
    """A table's shared memory cannot grow: its shm directory is full (gRPC RESOURCE_EXHAUSTED).

    An OSError with errno ENOSPC, so every path that maps ENOSPC to RESOURCE_EXHAUSTED maps it.
    """

    def __init__(self, table: str, nbytes: int, shm_dir: str, reason: str):
        super().__init__(errno.ENOSPC, reason)
        self.table, self.nbytes, self.shm_dir, self.reason = table, int(nbytes), shm_dir, reason

    def __str__(self) -> str:
        return (f"table '{self.table}' needs {self.nbytes} more bytes of shared memory in {self.shm_dir} "
                f"({self.reason}): give {self.shm_dir} more room (e.g. `mount -o remount,size=<bytes> "
                f"{self.shm_dir}`, `docker run --shm-size=<bytes>`, a larger emptyDir medium: Memory in "
                f"Kubernetes), point shm_dir at a larger tmpfs, or lower the table's max_size "
                f"(docs/OPERATIONS.md, sizing /dev/shm)")


class NeedsInlinePlane(GearServerError):
    """A reader by reference (shm, rdma) asked a table that holds items outside its column layout:
    those travel inline only (the data-plane session is ended so the learner negotiates again)."""
