"""The gRPC server options and port binding shared by the daemon and its ingest workers."""

from __future__ import annotations

import grpc
from grpc import aio

from gear_contract.channel import CHANNEL_OPTIONS

# Messages carry whole chunks and sample batches: raise gRPC's 4 MiB default.
GRPC_OPTIONS = [
    *CHANNEL_OPTIONS,
    # A port that is taken must fail to bind rather than be shared with another daemon.
    ("grpc.so_reuseport", 0),
]


def add_port(server: aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """The bound port, or 0 when the address cannot be bound (gRPC raises or returns 0 by version)."""
    try:
        if credentials is not None:  # TLS / mutual TLS ([auth] section)
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0


def bind(server: aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """``add_port`` of ``host:port``; ``[::]`` on a host without IPv6 falls back to every IPv4 interface."""
    bound = add_port(server, f"{host}:{port}", credentials)
    if not bound and host == "[::]":
        bound = add_port(server, f"0.0.0.0:{port}", credentials)
    return bound
