"""One channel to a gear daemon: a bounded wait for it, and a clear error naming why it is unreachable.

gRPC's ``wait_for_ready`` waits forever for a daemon that is down; a call
without it fails at once while the daemon restarts. ``DaemonChannel`` sits
between: before a call it waits for the channel to be ready for at most the
connect timeout (``Client(..., connect_timeout=)``, else ``GEAR_CONNECT_TIMEOUT``
seconds, default 30; ``-1``/``inf``: wait forever), logging every few seconds
what it waits for, then raises :class:`~gear_client.errors.ConnectError` naming
the address and the cause: refused, unresolvable, TLS or token. Calls then go
out fail-fast, so a daemon that vanishes mid-call gives that error too, never
a silent hang. Calls go out first (no cost while the daemon is up) and wait
only once one fails UNAVAILABLE; writers and data-plane sessions wait before
they open. Waiting probes with fail-fast ServerInfo calls (it also checks the
token) rather than watching the channel's connectivity: that watch is a gRPC
thread that races the channel's close.

On the daemon's host, ``local_lane()`` gives the daemon's local lane
(gear_client/connection/lane_client.py) once it answered where it is; a lane that breaks
is dropped and asked for again a little later (a restarted daemon has a new one).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
from typing import Any

import grpc
import grpc.aio

from gear_client.connection import aio_loop
from gear_client.connection.auth import ChannelSecurity
from gear_client.connection.lane_client import NOT_LOCAL, LocalLane, lane_enabled, open_local_lane
from gear_client.errors import ConnectError, DeadlineExceededError
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.channel import CHANNEL_OPTIONS

__all__ = ["DaemonChannel", "check_address", "connect_timeout_option", "DEFAULT_CONNECT_TIMEOUT_S"]

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_ENV = "GEAR_CONNECT_TIMEOUT"
# While waiting: the first log line after this long, then one every LOG_INTERVAL_S.
FIRST_LOG_S = 0.5
LOG_INTERVAL_S = 3.0
_POLL_S = 0.25
_PROBE_TIMEOUT_S = 2.0
# Reconnect quickly to a daemon that is starting (gRPC's default back-off grows to 120 s).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_CREDENTIAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_AWAY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # no answer from a daemon
_SAMPLE_METHOD = "/gear.v1.ReplayService/Sample"
_SERVER_INFO_METHOD = "/gear.v1.ReplayService/ServerInfo"
_MUTATE_METHOD = "/gear.v1.ReplayService/MutatePriorities"
# After the local lane broke or was not offered: seconds before the daemon is asked for it again.
LANE_RETRY_S = 1.0
# gRPC target schemes whose address names no TCP port (or that take a port themselves).
_NO_PORT_SCHEMES = ("unix:", "unix-abstract:", "vsock:")
_PORT = re.compile(r":(\d{1,5})$")


def check_address(address: str) -> str:
    """``address`` if it names a port; ValueError otherwise (gRPC would quietly dial port 443)."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"server_address must be a non-empty string 'host:port', got {address!r}")
    address = address.strip()
    if address.startswith(_NO_PORT_SCHEMES):
        return address
    target = address
    if "://" in target:  # dns://[authority]/host:port
        target = target.split("://", 1)[1].split("/", 1)[-1]
    elif target.startswith(("dns:", "ipv4:", "ipv6:")):
        target = target.split(":", 1)[1]
    for part in target.split(","):  # ipv4:a:p,b:p lists
        match = _PORT.search(part)
        if match is None or (part.startswith("[") and "]:" not in part) or (
                not part.startswith("[") and part.count(":") > 1):
            raise ValueError(
                f"server_address {address!r} names no port: write 'host:port' (e.g. 'localhost:{{server.port}}', "
                "'[::1]:8000'); without a port gRPC would dial 443")
        if not 0 < int(match.group(1)) <= 65535:
            raise ValueError(f"server_address {address!r}: port {match.group(1)} is not in 1..65535")
    return address


def connect_timeout_option(value: float | None) -> float | None:
    """Seconds a call waits for the daemon (None: forever) from the keyword, else ``GEAR_CONNECT_TIMEOUT``."""
    source = "connect_timeout"
    if value is None:
        text = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_CONNECT_TIMEOUT_S
        source = CONNECT_TIMEOUT_ENV
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{CONNECT_TIMEOUT_ENV}={text!r} is not a number of seconds (-1: wait forever)") from None
    value = float(value)
    if math.isnan(value) or value == 0:
        raise ValueError(f"{source} must be a positive number of seconds or -1 (wait forever), got {value}")
    return None if value < 0 or math.isinf(value) else value


class DaemonChannel:
    """A gRPC channel to one daemon with a bounded wait for readiness (see module docstring). Thread safe."""

    def __init__(self, address: str, security: ChannelSecurity, connect_timeout: float | None):
        """``connect_timeout``: seconds a call waits for the daemon, None: forever (see connect_timeout_option).

        The sync channel is made on first use; writers' streams and their ServerInfo go on an aio channel
        (``aio_channel``) driven by the process's loop thread (gear_client/connection/aio_loop.py), so an
        actor that only writes makes one connection and no thread of its own.
        """
        self.address = check_address(address)
        self.connect_timeout = connect_timeout
        self.security = security  # the stream plane's bulk connections use the same TLS settings
        self.tls = security.tls
        self.root_certificates = security.root_certificates
        self.has_token = security.token is not None
        self._security = security
        self._options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
        self._channel_lock = threading.Lock()
        self._sync: tuple[grpc.Channel, Any, Any, Any] | None = None  # (channel, stub, sample call, mutate call)
        self._aio: grpc.aio.Channel | None = None
        self.call_metadata = security.call_metadata  # for calls on the aio channel
        self._closed = False
        self._lane: LocalLane | None = None
        self._lane_wanted = lane_enabled()
        self._lane_next_try = 0.0
        self._lane_lock = threading.Lock()

    def _sync_parts(self) -> tuple[grpc.Channel, Any, Any, Any]:
        parts = self._sync
        if parts is None:
            with self._channel_lock:
                parts = self._sync
                if parts is None:
                    channel = self._security.channel(self.address, options=self._options)
                    # Sample responses are parsed by hand (gear_contract.wire.decode_sample_response) and
                    # MutatePriorities requests framed by hand (gear_contract.wire.encode_priority_updates).
                    parts = self._sync = (
                        channel, pb_grpc.ReplayServiceStub(channel),
                        channel.unary_stream(_SAMPLE_METHOD, request_serializer=pb.SampleRequest.SerializeToString,
                                             response_deserializer=None),
                        channel.unary_unary(_MUTATE_METHOD, request_serializer=None, response_deserializer=None))
        return parts

    @property
    def channel(self) -> grpc.Channel:
        """The sync gRPC channel (made on first use)."""
        return self._sync_parts()[0]

    @property
    def stub(self) -> pb_grpc.ReplayServiceStub:
        return self._sync_parts()[1]

    @property
    def sample_call(self) -> Any:
        return self._sync_parts()[2]

    @property
    def mutate_call(self) -> Any:
        return self._sync_parts()[3]

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The sync channel's ``unary_unary`` (a ``DaemonWatch`` probes through it: made only when it does)."""
        return self.channel.unary_unary(method, *args, **kwargs)

    def aio_channel(self) -> grpc.aio.Channel:
        """The aio channel (made on first use; call on the process's loop thread, which drives it)."""
        if self._aio is None:
            if self._closed:
                raise ValueError(f"the channel to {self.address} is closed")
            self._aio = self._security.aio_channel(self.address, options=self._options)
        return self._aio

    async def server_info_aio(self, timeout: float | None) -> pb.ServerInfoResponse:
        """One fail-fast ServerInfo call on the aio channel (its RpcError when the daemon does not answer)."""
        channel = self.aio_channel()
        call = channel.unary_unary(_SERVER_INFO_METHOD, request_serializer=pb.ServerInfoRequest.SerializeToString,
                                   response_deserializer=pb.ServerInfoResponse.FromString)
        return await call(pb.ServerInfoRequest(), timeout=timeout, metadata=self.call_metadata,
                          wait_for_ready=False)

    def close(self) -> None:
        """Close the channels first (cancelling their calls in flight, a lane lookup that holds the lane's lock
        included), then the lane: never waits on a blocked call."""
        self._lane_wanted = False
        with self._channel_lock:
            parts, self._sync = self._sync, None
            self._closed = True
        if parts is not None:
            parts[0].close()
        aio_loop.call_soon(self._close_aio)
        with self._lane_lock:
            lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()

    def _close_aio(self) -> None:
        channel, self._aio = self._aio, None
        if channel is not None:
            asyncio.ensure_future(channel.close())

    # ------------------------------------------------------------------ local lane
    def local_lane(self) -> LocalLane | None:
        """The daemon's local lane when it runs on this host and offers one (asked at most every
        ``LANE_RETRY_S`` seconds while it does not); None: use gRPC."""
        lane = self._lane
        if lane is not None or not self._lane_wanted or time.monotonic() < self._lane_next_try:
            return lane
        with self._lane_lock:
            if self._lane is not None or not self._lane_wanted or time.monotonic() < self._lane_next_try:
                return self._lane
            found = open_local_lane(self.stub)
            if found is NOT_LOCAL:
                self._lane_wanted = False
            elif found is None:
                self._lane_next_try = time.monotonic() + LANE_RETRY_S
            else:
                self._lane = found
            return self._lane

    def lane_broken(self, lane: LocalLane) -> None:
        """Drop ``lane`` after a failed call (asked for again after ``LANE_RETRY_S``)."""
        with self._lane_lock:
            if self._lane is lane:
                self._lane = None
                self._lane_next_try = time.monotonic() + LANE_RETRY_S
        lane.close()

    # ------------------------------------------------------------------ waiting
    def wait_ready(self, operation: str, timeout: float | None = None) -> None:
        """Return once the daemon answers; ConnectError naming the cause after the connect timeout.

        ``timeout`` (seconds): the caller's own deadline; when it is the shorter
        one, DeadlineExceededError (Reverb's error for a timed-out call). A
        refused token raises at once: waiting cannot fix it.
        """
        limit = self.connect_timeout
        own_deadline = timeout is not None and (limit is None or timeout < limit)
        if own_deadline:
            limit = timeout
        start = time.monotonic()
        deadline = None if limit is None else start + limit
        next_log = start + FIRST_LOG_S
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            error = self._probe(_PROBE_TIMEOUT_S if remaining is None else max(0.05, min(_PROBE_TIMEOUT_S, remaining)))
            if error is None:
                return
            now = time.monotonic()
            if error.code() in _CREDENTIAL_CODES:
                raise self.error_for(error, operation)
            if error.code() not in _AWAY_CODES:
                return  # the daemon answered (busy, say): the call itself gets its own status
            if deadline is not None and now >= deadline:
                cause, text = self.explain(error)
                message = f"{operation}: no gear daemon reachable at {self.address} within {limit:g} s: {text}"
                if own_deadline:
                    raise DeadlineExceededError(message)
                raise ConnectError(message + _timeout_hint(), address=self.address, cause=cause)
            if now >= next_log:
                waited = f"{now - start:.0f} s of {limit:g} s" if limit is not None else f"{now - start:.0f} s"
                log.warning("waiting for the gear daemon at %s (%s), %s: %s", self.address, operation, waited,
                            self.explain(error)[1])
                next_log = now + LOG_INTERVAL_S
            time.sleep(_POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - now)))

    def _probe(self, timeout: float) -> grpc.RpcError | None:
        """None when the daemon answers a ServerInfo now, else the call's error (fail-fast: no waiting)."""
        try:
            self.stub.ServerInfo(pb.ServerInfoRequest(), timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as error:
            return error
        return None

    def explain(self, error: grpc.RpcError) -> tuple[str, str]:
        """(cause, explanation) of a failed call: refused, unresolvable, tls, token, unreachable or unavailable."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = (error.details() if callable(getattr(error, "details", None)) else None) or str(error)
        lowered = details.lower()
        if code in _CREDENTIAL_CODES:
            given = ("the token given" if self.has_token
                     else "no token (pass token= or set GEAR_TOKEN / GEAR_TOKEN_FILE)")
            return "token", f"the daemon at {self.address} refused the call's credentials ({details}); sent {given}"
        if "resolv" in lowered or "dns" in lowered or "name not found" in lowered or "lookup" in lowered:
            return "unresolvable", f"the host of {self.address} cannot be resolved ({details})"
        # gRPC reports the last address it tried ("localhost" is ::1 and 127.0.0.1): ask the port itself.
        transport = self._probe_transport()
        if transport is not None:
            speaks_tls, verify_error = transport
            if speaks_tls and not self.tls:
                return "tls", (f"the daemon at {self.address} speaks TLS but this client connects in plaintext: "
                               "pass root_certificates= (or set GEAR_TLS_ROOT_CERTS)")
            if self.tls and not speaks_tls:
                return "tls", (f"the daemon at {self.address} does not speak TLS but this client does "
                               "(root_certificates= or GEAR_TLS_ROOT_CERTS): drop them or turn TLS on in the daemon")
            if self.tls and verify_error:
                return "tls", (f"TLS handshake with {self.address} failed: {verify_error} (check root_certificates / "
                               "GEAR_TLS_ROOT_CERTS)")
        if any(word in lowered for word in ("ssl", "tls", "handshake", "certificate")):
            return "tls", f"TLS handshake with {self.address} failed ({details})"
        if "connection refused" in lowered:
            return "refused", (f"connection refused: nothing listens on {self.address} (is the daemon running, "
                               "on this port?)")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "unreachable", f"{self.address} did not answer ({details})"
        return "unavailable", f"{self.address} is unavailable ({details})"

    def _probe_transport(self) -> tuple[bool, str | None] | None:
        """None when no TCP connection opens; else (the port speaks TLS, why our roots do not verify it)."""
        host, _, port = self.address.rpartition(":")
        if not port.isdigit() or "://" in host or host.startswith(("dns:", "ipv4:", "ipv6:", "unix")):
            return None
        host = host.strip("[]")
        try:
            socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S).close()
        except OSError:
            return None
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        if not _handshake(unverified, host, int(port)):
            return False, None
        if self.root_certificates is None:
            return True, None
        verified = ssl.create_default_context(cadata=self.root_certificates.decode())
        try:
            _handshake(verified, host, int(port), raise_errors=True)
        except ssl.SSLError as error:
            return True, getattr(error, "verify_message", None) or error.reason or str(error)
        return True, None

    def error_for(self, error: grpc.RpcError, operation: str) -> ConnectError | None:
        """A ConnectError for a call that failed because the daemon is away or refused the credentials."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        if code != grpc.StatusCode.UNAVAILABLE and code not in _CREDENTIAL_CODES:
            return None
        cause, text = self.explain(error)
        return ConnectError(f"{operation}: {text}", address=self.address, cause=cause)


def _handshake(context: ssl.SSLContext, host: str, port: int, raise_errors: bool = False) -> bool:
    """Whether a TLS handshake with host:port completes under ``context``."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLError:
        if raise_errors:
            raise
        return False
    except OSError:
        return False


def _timeout_hint() -> str:
    return f" (connect_timeout=, or {CONNECT_TIMEOUT_ENV} seconds; -1 waits forever)"
