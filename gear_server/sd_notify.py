"""systemd readiness notification (sd_notify) over $NOTIFY_SOCKET, without extra packages.

With ``Type=notify`` systemd waits for ``READY=1`` before it calls the service
started; the daemon sends it once its tables are restored and the gRPC port
serves. Outside systemd (no ``$NOTIFY_SOCKET``) every call is a cheap no-op.
The protocol is one datagram of newline-separated ``KEY=VALUE`` lines to a
Unix socket whose path may start with ``@`` (abstract namespace).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*lines: str) -> bool:
    """Send ``lines`` as one notification; True when a notify socket took it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    message = "\n".join(lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message)
    except OSError as exc:
        # A lost notification must not take the daemon down; systemd's start
        # timeout reports it.
        log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def ready(status: str = "") -> bool:
    """Tell systemd the service is up (tables restored, gRPC serving).

    No MAINPID: the daemon is the unit's main process, and with the default
    ``NotifyAccess=main`` systemd ignores a child that inherited the socket.
    """
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


def status(text: str) -> bool:
    """Free-form status line shown by ``systemctl status``."""
    return notify(f"STATUS={text}")


def stopping(status: str = "") -> bool:
    """Tell systemd the daemon is shutting down (final checkpoint under way)."""
    return notify("STOPPING=1", *([f"STATUS={status}"] if status else []))


def extend_timeout(seconds: float) -> bool:
    """Ask systemd for ``seconds`` more before its start/stop timeout fires (long restores, checkpoints)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")
