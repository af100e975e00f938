"""Telling a daemon that answers slowly from one that does not answer at all.

A writer's stream may wait a long time for an answer and be right to: the
table's rate limiter holds its inserts back. It may also wait for ever on a
daemon that stopped answering without closing the connection (a process
stopped or wedged, a host cut off the network): nothing ends the stream. A
``DaemonWatch`` tells the two apart. A thread that waits on the stream asks
``away(quiet_since)`` as it polls; once the stream has been silent for a
moment the watch sends fail-fast ServerInfo probes over the stream's channel
(futures: the waiter never blocks on one). Any answer, even an error status,
shows the daemon alive. The daemon counts as away once neither the stream nor
a probe got an answer for ``timeout_s`` (the client's connect timeout).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import grpc

from gear_contract._proto import replay_pb2 as pb

__all__ = ["DaemonWatch", "DaemonNotAnswering"]

SERVER_INFO_METHOD = "/gear.v1.ReplayService/ServerInfo"
# Probing starts after this much silence (or the timeout, if shorter); one probe at a time, at most this often.
PROBE_AFTER_S = 1.0
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0
_AWAY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class DaemonNotAnswering(RuntimeError):
    """The daemon gave no answer, to the stream nor to a probe, for the whole timeout."""

    def __init__(self, message: str, address: str = ""):
        super().__init__(message)
        self.address = address


class DaemonWatch:
    """Probes of one channel's daemon while a stream on it waits (see the module docstring). Thread safe."""

    def __init__(self, channel: grpc.Channel, timeout_s: float | None,
                 metadata: Sequence[tuple[str, str]] | None = None):
        """``timeout_s``: seconds of silence after which the daemon is away (None or inf: never)."""
        self.timeout_s = None if timeout_s is None or math.isinf(timeout_s) else float(timeout_s)
        self._metadata = metadata
        self._call = channel.unary_unary(SERVER_INFO_METHOD, request_serializer=pb.ServerInfoRequest.SerializeToString,
                                         response_deserializer=None)
        self._lock = threading.RLock()  # a probe that is done at once runs its callback under the lock
        self._probe: grpc.Future | None = None
        self._next_probe = 0.0
        self._alive_at = -math.inf  # when the latest probe that got an answer was sent

    def away(self, quiet_since: float) -> bool:
        """Whether the daemon has answered nothing since ``quiet_since`` (monotonic seconds) for the timeout.

        Call it while waiting on the stream; it sends a probe when one is due and never blocks.
        """
        if self.timeout_s is None:
            return False
        now = time.monotonic()
        if now - quiet_since < min(PROBE_AFTER_S, self.timeout_s):
            return False
        with self._lock:
            if self._probe is None and now >= self._next_probe:
                self._next_probe = now + PROBE_INTERVAL_S
                try:
                    probe = self._call.future(pb.ServerInfoRequest(), timeout=min(PROBE_TIMEOUT_S, self.timeout_s),
                                              metadata=self._metadata, wait_for_ready=False)
                except (ValueError, RuntimeError):  # the channel was closed: nothing will answer
                    probe = None
                if probe is not None:
                    self._probe = probe
                    probe.add_done_callback(lambda done, sent=now: self._probe_done(done, sent))
            return now - max(quiet_since, self._alive_at) >= self.timeout_s

    def _probe_done(self, probe: grpc.Future, sent_at: float) -> None:
        answered = not probe.cancelled() and (probe.exception() is None or probe.code() not in _AWAY_CODES)
        with self._lock:
            if self._probe is probe:
                self._probe = None
            if answered:
                self._alive_at = max(self._alive_at, sent_at)

    def close(self) -> None:
        """Cancel a probe in flight."""
        with self._lock:
            probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
