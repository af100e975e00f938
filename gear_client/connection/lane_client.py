"""The client's end of the local lane (gear_contract/lane_frames.py): calls to a daemon on this host, off gRPC.

``open_local_lane(stub)`` asks the daemon where its lane is (a ServerInfo with
the lane's metadata key) and connects when the daemon runs on this host.
``LocalLane.call`` sends one call on a connection of its own (connections are
pooled: one per call in flight) and returns the answer's bytes; ``submit``
sends it and returns a ``LanePending`` to collect the answer later (a learner
keeps Selects in flight), and ``future`` wraps that as a grpc future of a
response message. A call the daemon answers with an error status raises
``LaneStatusError``; one the lane cannot carry (the daemon went away or is
stopping, its lane is full) raises ``LaneBroken``: the caller then makes it
over gRPC, whose waiting and errors apply. Both are ``grpc.RpcError``s with
``code()`` and ``details()``, so code that handles the RPC's errors handles
them too. A lane made before ``fork()`` is not used by the child (it opens its
own connections).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import grpc

from gear_contract._proto import replay_pb2 as pb
from gear_contract.lane_frames import (
    HEAD,
    LANE_KEY,
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    frame,
    hello,
    lane_enabled,
    parse_advertisement,
)
from gear_contract.negotiation import local_host_id

__all__ = ["LocalLane", "LanePending", "LaneFuture", "LaneBroken", "LaneStatusError", "NOT_LOCAL",
           "open_local_lane", "lane_enabled"]

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK.value[0]
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_NEGOTIATE_TIMEOUT_S = 5.0
_READ_BYTES = 1 << 16


class LaneStatusError(grpc.RpcError):
    """A call the daemon answered with an error status; ``code()`` and ``details()`` as the RPC's error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LaneBroken(LaneStatusError):
    """The lane could not carry the call (connection failed, daemon stopping, lane full): use gRPC.

    Its code is UNAVAILABLE (or the daemon's RESOURCE_EXHAUSTED for a full lane).
    """

    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(code, details)


NOT_LOCAL = "not local"  # open_local_lane's answer for a daemon on another host


def open_local_lane(stub, timeout: float = _NEGOTIATE_TIMEOUT_S, metadata: Any = None) -> LocalLane | str | None:
    """A connected lane to the daemon behind ``stub``; ``NOT_LOCAL`` when it runs on another host; None when
    it offers none now (not reachable, no lane, refused). ``metadata``: the caller's (a token, say)."""
    try:
        response, call = stub.ServerInfo.with_call(pb.ServerInfoRequest(),
                                                   metadata=(*(metadata or ()), (LANE_KEY, "1")),
                                                   timeout=timeout, wait_for_ready=False)
    except grpc.RpcError:
        return None
    if response.host_id != local_host_id():
        return NOT_LOCAL
    advertised = next((parse_advertisement(value) for key, value in call.trailing_metadata() or ()
                       if key == LANE_KEY), None)
    if advertised is None:
        return None
    lane = LocalLane(*advertised)
    try:
        lane.check()
    except LaneStatusError as e:
        log.info("not using the daemon's local lane: %s", e)
        lane.close()
        return None
    return lane


_MAX_IDLE = 8  # connections a process keeps open between calls (the daemon serves 64 in all)
_LANES: weakref.WeakSet[LocalLane] = weakref.WeakSet()


def _forget_after_fork() -> None:
    """In a forked child: drop (never use or shut down) the parent's connections, and a lock it may have held."""
    for lane in list(_LANES):
        lane._idle, lane._pid, lane._lock = [], os.getpid(), threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


class LocalLane:
    """Pooled connections to one daemon's lane. Thread safe."""

    def __init__(self, name: str, secret: bytes):
        self.name = name
        self._secret = secret
        self._idle: list[socket.socket] = []
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.Lock()
        _LANES.add(self)

    def check(self) -> None:
        """Open one connection now (LaneBroken / LaneStatusError when the daemon refuses it)."""
        self._release(self._connect())

    def call(self, kind: int, payload: bytes) -> bytes | memoryview:
        """One call's answer; LaneStatusError for an error status, LaneBroken when it must go over gRPC."""
        return self.submit(kind, payload).result()

    def submit(self, kind: int, payload: bytes) -> LanePending:
        """Send one call; its answer comes with ``result()``. LaneBroken when it could not be sent."""
        if len(payload) + 1 > MAX_REQUEST_BYTES:
            raise LaneBroken(f"a request of {len(payload)} bytes is larger than the lane takes")
        conn = self._take()
        try:
            conn.sendall(frame(kind, payload))
        except OSError as e:
            conn.close()
            raise LaneBroken(f"the local lane connection failed: {e}") from e
        return LanePending(self, conn)

    def future(self, kind: int, request: Any, response_type: Any) -> LaneFuture:
        """``submit`` of a request message, as a grpc future of a ``response_type`` message."""
        return LaneFuture(self.submit(kind, request.SerializeToString()), response_type)

    def close(self) -> None:
        """Close the idle connections; calls in flight close theirs when done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ------------------------------------------------------------------ connections
    def _take(self) -> socket.socket:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's connections are not ours
                self._idle, self._pid = [], os.getpid()
            if self._closed:
                raise LaneBroken("the local lane was closed")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _release(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed and self._pid == os.getpid() and len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect("\0" + self.name)
            conn.sendall(hello(self._secret))
            code, answer = _Answer().read(conn, _NEGOTIATE_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            conn.close()
            raise LaneBroken(f"cannot open the local lane: {e!r}") from e
        if code != _OK:  # full, stopping or refused: the call goes over gRPC, which says what is wrong
            conn.close()
            error = _error(code, answer)
            raise error if isinstance(error, LaneBroken) else LaneBroken(str(error), error.code())
        return conn


class LanePending:
    """A call sent on its own connection; ``result()`` reads its answer, then the connection goes back."""

    def __init__(self, lane: LocalLane, conn: socket.socket):
        self._lane = lane
        self._conn: socket.socket | None = conn
        self._answer = _Answer()
        self._outcome: tuple[int, bytes] | None = None
        self._failure: LaneStatusError | None = None
        self.cancelled = False

    def result(self, timeout: float | None = None) -> bytes | memoryview:
        """The answer's bytes; LaneStatusError / LaneBroken as ``LocalLane.call``; grpc.FutureTimeoutError
        when ``timeout`` seconds pass first (the answer may still be read later)."""
        self._wait(timeout)
        if self._failure is not None:
            raise self._failure
        code, answer = self._outcome
        if code != _OK:
            raise _error(code, answer)
        return answer

    def done(self) -> bool:
        """Whether the answer is in (or the call failed or was cancelled)."""
        if self._conn is None:
            return True
        try:
            self._wait(0.0)
        except grpc.FutureTimeoutError:
            return False
        return True

    def cancel(self) -> bool:
        """Give up the call (the daemon cancels it when the connection closes); False once it ended."""
        if self._conn is None:
            return False
        if self._lane._pid == os.getpid():  # a forked child may hold a copy: make the daemon see the end
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._conn.close()
        self._conn = None
        self.cancelled = True
        self._failure = LaneStatusError(grpc.StatusCode.CANCELLED, "the call was cancelled")
        return True

    def _wait(self, timeout: float | None) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            outcome = self._answer.read(conn, timeout)
        except TimeoutError:
            raise grpc.FutureTimeoutError() from None
        except OSError as e:
            self._conn = None
            conn.close()
            self._failure = LaneBroken(f"the local lane connection failed: {e}")
            return
        self._conn = None
        self._outcome = outcome
        self._lane._release(conn)


class LaneFuture:
    """A lane call as a grpc future of a response message: ``result``, ``done``, ``cancel``."""

    def __init__(self, pending: LanePending, response_type: Any):
        self._pending = pending
        self._type = response_type

    def result(self, timeout: float | None = None) -> Any:
        return self._type.FromString(self._pending.result(timeout))

    def done(self) -> bool:
        return self._pending.done()

    def cancel(self) -> bool:
        return self._pending.cancel()

    def cancelled(self) -> bool:
        return self._pending.cancelled


class _Answer:
    """One answer frame read from a connection, in as many pieces (and waits) as it takes.

    Once the head has come, the rest is received straight into one buffer of the
    frame's size (a Select of thousands of items is hundreds of KiB: no copy per
    piece); the payload is handed out as a view of it.
    """

    __slots__ = ("_data", "_frame", "_got", "_code")

    def __init__(self) -> None:
        self._data = b""  # what came before the head was complete
        self._frame: bytearray | None = None  # the whole frame, once its length is known
        self._got = 0
        self._code = 0

    def read(self, conn: socket.socket, timeout: float | None) -> tuple[int, bytes | memoryview]:
        """(status code, payload); TimeoutError after ``timeout`` seconds (what came is kept); OSError
        (ConnectionResetError) when the connection ends first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = self._frame
            if frame is None and len(self._data) >= HEAD.size:
                data = self._data
                length, code = HEAD.unpack_from(data)
                if length < 1 or 4 + length > MAX_FRAME_BYTES:
                    raise ConnectionResetError(f"a local lane answer of {length} bytes")
                self._data = b""
                if len(data) >= 4 + length:
                    return code, data[HEAD.size:4 + length]
                frame = self._frame = bytearray(4 + length)
                frame[:len(data)] = data
                self._got, self._code = len(data), code
            if frame is not None and self._got == len(frame):
                self._frame = None
                return self._code, memoryview(frame)[HEAD.size:]
            if deadline is not None:
                conn.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                if frame is None:
                    more = conn.recv(_READ_BYTES)
                    got = len(more)
                else:
                    got = conn.recv_into(memoryview(frame)[self._got:])
            except BlockingIOError:  # timeout 0: nothing yet
                raise TimeoutError from None
            finally:
                if deadline is not None:
                    conn.settimeout(None)
            if not got:
                raise ConnectionResetError("the daemon closed the local lane connection")
            if frame is None:
                self._data += more
            else:
                self._got += got


def _error(code: int, answer: bytes | memoryview) -> LaneStatusError:
    """A call's error status: UNAVAILABLE (the daemon is stopping) sends the call over gRPC; any other is
    the call's own answer, as the RPC would give it."""
    status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    details = bytes(answer).decode(errors="replace")
    if status is grpc.StatusCode.UNAVAILABLE:
        return LaneBroken(f"the daemon answered {status.name}: {details}", status)
    return LaneStatusError(status, details)
