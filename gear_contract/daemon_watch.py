"""Telling a daemon that answers slowly from one that does not answer at all.

A writer's stream may wait a long time for an answer and be right to: the
table's rate limiter holds its inserts back. It may also wait for ever on a
daemon that stopped answering without closing the connection (a process
stopped or wedged, a host cut off the network): nothing ends the stream. A
``DaemonWatch`` tells the two apart. A thread that waits on the stream asks
``away(quiet_since)`` as it polls; once the stream has been silent for half
the timeout the watch sends fail-fast ServerInfo probes over the stream's
channel (futures: the waiter never blocks on one). Any answer, even an error
status, shows the daemon alive. The daemon counts as away once neither the
stream nor a probe got an answer for ``timeout_s`` (the client's connect
timeout). The streams of one channel share its probes, so a thousand writers
held back by a rate limiter send one probe at a time, not a thousand.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Sequence

import grpc

from gear_contract._proto import replay_pb2 as pb

__all__ = ["DaemonWatch", "DaemonNotAnswering"]

SERVER_INFO_METHOD = "/gear.v1.ReplayService/ServerInfo"
# Probing starts after half the timeout of silence (at least this long); one probe at a time, at most this often.
MIN_PROBE_AFTER_S = 0.5
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0
_AWAY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class DaemonNotAnswering(RuntimeError):
    """The daemon gave no answer, to the stream nor to a probe, for the whole timeout."""

    def __init__(self, message: str, address: str = ""):
        super().__init__(message)
        self.address = address


_probers_lock = threading.Lock()
_probers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # channel -> _Prober


class _Prober:
    """The ServerInfo probes of one channel, shared by the watches of all its streams."""

    @classmethod
    def of(cls, channel: grpc.Channel, metadata: Sequence[tuple[str, str]] | None) -> _Prober:
        if metadata:
            return cls(channel, metadata)
        with _probers_lock:
            try:
                prober = _probers.get(channel)
                if prober is None:
                    prober = _probers[channel] = cls(channel, None)
            except TypeError:  # a channel without weak references: probes of its own
                prober = cls(channel, None)
            return prober

    def __init__(self, channel: grpc.Channel, metadata: Sequence[tuple[str, str]] | None):
        self._channel = weakref.ref(channel)  # lives beside its channel, does not keep it open
        self._metadata = metadata
        self._lock = threading.RLock()  # a probe that is done at once runs its callback under the lock
        self._probe: grpc.Future | None = None
        self._next_probe = 0.0
        self.alive_at = -math.inf  # when the latest probe that got an answer was sent

    def probe(self, timeout_s: float) -> None:
        """Send a fail-fast ServerInfo unless one is in flight or one went out less than PROBE_INTERVAL_S ago."""
        now = time.monotonic()
        with self._lock:
            if self._probe is not None or now < self._next_probe:
                return
            self._next_probe = now + PROBE_INTERVAL_S
            channel = self._channel()
            try:
                call = channel.unary_unary(SERVER_INFO_METHOD, response_deserializer=None,
                                           request_serializer=pb.ServerInfoRequest.SerializeToString)
                probe = call.future(pb.ServerInfoRequest(), timeout=min(PROBE_TIMEOUT_S, timeout_s),
                                    metadata=self._metadata, wait_for_ready=False)
            except (AttributeError, ValueError, RuntimeError):  # the channel is gone or closed: no answer
                return
            self._probe = probe
            probe.add_done_callback(lambda done, sent=now: self._done(done, sent))

    def _done(self, probe: grpc.Future, sent_at: float) -> None:
        answered = not probe.cancelled() and (probe.exception() is None or probe.code() not in _AWAY_CODES)
        with self._lock:
            if self._probe is probe:
                self._probe = None
            if answered:
                self.alive_at = max(self.alive_at, sent_at)


class DaemonWatch:
    """One stream's watch of its daemon (see the module docstring). Cheap to make: the channel's shared
    prober is looked up only once the stream has been silent for half the timeout. Thread safe."""

    def __init__(self, channel: grpc.Channel, timeout_s: float | None,
                 metadata: Sequence[tuple[str, str]] | None = None):
        """``timeout_s``: seconds of silence after which the daemon is away (None or inf: never)."""
        self.timeout_s = None if timeout_s is None or math.isinf(timeout_s) else float(timeout_s)
        self._probe_after = None if self.timeout_s is None else max(MIN_PROBE_AFTER_S, self.timeout_s / 2)
        self._channel = channel
        self._metadata = metadata
        self._prober: _Prober | None = None

    def away(self, quiet_since: float) -> bool:
        """Whether the daemon has answered nothing since ``quiet_since`` (monotonic seconds) for the timeout.

        Call it while waiting on the stream; it sends a probe when one is due and never blocks.
        """
        if self._probe_after is None or time.monotonic() - quiet_since < self._probe_after:
            return False
        if self._prober is None:
            self._prober = _Prober.of(self._channel, self._metadata)
        self._prober.probe(self.timeout_s)
        return time.monotonic() - max(quiet_since, self._prober.alive_at) >= self.timeout_s

    def recheck_in(self, quiet_since: float) -> float | None:
        """Seconds until ``away`` may say something new for a stream silent since ``quiet_since`` (None: never):
        a waiter sleeps that long, so a stream that gets its answers in time costs no wake-ups."""
        if self._probe_after is None:
            return None
        return max(quiet_since + self._probe_after - time.monotonic(), PROBE_INTERVAL_S / 2)
