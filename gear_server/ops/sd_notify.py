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
import time

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


# -- watchdog (WatchdogSec= in the unit) -----------------------------------------

_last_keep_alive = 0.0


def watchdog_interval() -> float | None:
    """Seconds between keep-alives (half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled advises).

    None when systemd runs no watchdog for this process (no ``$WATCHDOG_USEC``,
    or ``$WATCHDOG_PID`` names another process).
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


def keep_alive(now: float | None = None) -> bool:
    """Send ``WATCHDOG=1`` when one is due (at most every ``watchdog_interval()``); True when sent.

    Call it often from the loop whose progress it vouches for (the daemon's
    serving loop): if that loop wedges, the keep-alives stop and systemd
    restarts the service after ``WatchdogSec``.
    """
    global _last_keep_alive
    interval = watchdog_interval()
    if interval is None:
        return False
    now = time.monotonic() if now is None else now
    if now - _last_keep_alive < interval:
        return False
    _last_keep_alive = now
    return notify("WATCHDOG=1")


async def keep_alive_forever(period_s: float | None = None) -> None:
    """Run in the asyncio serving loop: a keep-alive every ``period_s`` (default: half the watchdog).

    Returns at once without a watchdog; cancel the task to stop it.
    """
    import asyncio

    interval = watchdog_interval()
    if interval is None:
        return
    period = min(period_s or interval, interval)
    while True:
        keep_alive()
        await asyncio.sleep(period / 2)
