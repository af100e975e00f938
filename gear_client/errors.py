"""Reverb's exception types and the mapping from a gRPC status to them.

Code written against Reverb catches ``ValueError`` for bad arguments,
``RuntimeError`` for service failures and ``reverb.errors.DeadlineExceededError``
for timeouts; every client call goes through :func:`from_rpc_error` so the
same exception types come out of gear.
"""

from __future__ import annotations

import grpc

__all__ = [
    "ReverbError",
    "DeadlineExceededError",
    "ServiceError",
    "ConnectError",
    "ItemsNotInsertedError",
    "from_rpc_error",
    "INSERT_OPERATIONS",
]


class ReverbError(Exception):
    """Base class of the errors gear raises itself (as Reverb's)."""


class DeadlineExceededError(ReverbError):
    """A call did not complete within its timeout (rate limiter or network)."""


class ServiceError(ReverbError, RuntimeError):
    """The service failed a call (unavailable, cancelled, internal...).

    Also a ``RuntimeError``, which is what Reverb raises in these cases.
    ``code`` is the ``grpc.StatusCode``.
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class ConnectError(ServiceError):
    """The daemon at ``address`` could not be reached or refused the credentials.

    ``cause`` says why: "refused" (nothing listens), "unresolvable" (unknown
    host), "tls" (handshake failed, or TLS on one side only), "token" (missing
    or wrong token), "unreachable" (no answer), "unavailable" (anything else).
    A ``RuntimeError`` (and a ReverbError), as Reverb's unavailable errors.
    """

    def __init__(self, message: str, *, address: str, cause: str):
        super().__init__(message, grpc.StatusCode.UNAVAILABLE if cause != "token" else grpc.StatusCode.UNAUTHENTICATED)
        self.address = address
        self.cause = cause


# Operations for which an unknown table is a bad argument (ValueError), as in
# Reverb; for every other operation it is a RuntimeError.
INSERT_OPERATIONS = frozenset({"insert", "create_item", "append", "flush", "end_episode", "writer"})


def _status_of(error: BaseException) -> tuple[grpc.StatusCode | None, str]:
    code = error.code() if hasattr(error, "code") and callable(error.code) else None
    details = error.details() if hasattr(error, "details") and callable(error.details) else None
    return code, (details or str(error))


def from_rpc_error(error: BaseException, operation: str) -> Exception:
    """The exception Reverb raises for ``error`` (a ``grpc.RpcError``) in ``operation``.

    ``operation`` names the client call ("sample", "insert", "create_item",
    "mutate_priorities", "reset", "server_info", ...); it decides how NOT_FOUND
    maps. The returned exception carries the server's message; raise it
    ``from error``.
    """
    code, details = _status_of(error)
    message = f"{operation}: {details}" if details else operation
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION):
        return ValueError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        if operation in INSERT_OPERATIONS:
            return ValueError(details)
        return RuntimeError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(message)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return NotImplementedError(message)
    code_name = code.name if code is not None else "UNKNOWN"
    return ServiceError(f"{message} ({code_name})", code)


class ItemsNotInsertedError(ServiceError):
    """A writer gave up on items: the daemon stayed unreachable past the writer's reconnect timeout.

    ``keys`` lists the items' keys; none of them was inserted, nor will be.
    """

    def __init__(self, message: str, keys: list[int] | tuple[int, ...]):
        super().__init__(message, grpc.StatusCode.UNAVAILABLE)
        self.keys = tuple(keys)
