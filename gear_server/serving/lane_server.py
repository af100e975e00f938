"""The daemon's end of the local lane (gear_contract/lane_frames.py): a thread per connection.

Each connection's thread reads a call, runs its handler and writes the answer:
one thread wakes per call and no event-loop or pool hop is paid, which is what
brings a call under Reverb's. A plain handler runs on that thread (it may block
on a table's lock: these threads are not the event loop). A coroutine handler
(a servicer method that waits on asyncio: Select's rate-limiter waits) runs on
an event loop of the connection's own thread, with a ``LaneContext`` for its
context (its table work inline: ``table_calls.InlineTableCalls``); a client
that goes away meanwhile (its socket reads EOF) cancels it, as gRPC cancels the
RPC. Connections are capped
(``max_connections``: a client beyond it is answered RESOURCE_EXHAUSTED and
keeps using gRPC). Handlers raise table errors (or abort through their
context); they end the call with the status ``gear_server.rpc.statuses.status_of``
gives them, as the RPC would. Each call is counted in the RPC metrics under its
method's name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import inspect
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import NoReturn

import grpc

from gear_contract.lane_frames import (
    HEAD,
    HELLO,
    MAX_HELLO_BYTES,
    MAX_REQUEST_BYTES,
    METHODS,
    SECRET_BYTES,
    VERSION,
    frame,
)
from gear_server.rpc.statuses import RefusalLog, status_of

log = logging.getLogger(__name__)

# A plain handler reads the request in place; a coroutine handler gets its bytes and a LaneContext.
Handler = Callable[[memoryview], bytes] | Callable[[bytes, "LaneContext"], Awaitable[bytes]]

DEFAULT_MAX_CONNECTIONS = 64
MAX_UNAUTHENTICATED = 8  # connections still before their hello (any local process can open one)
HELLO_TIMEOUT_S = 5.0  # the whole hello, however slowly its bytes come
CLOSE_WAIT_S = 5.0  # how long close() waits for calls being answered
KEEP_BUFFER_BYTES = 1 << 20  # a connection's read buffer goes back to 64 KiB after a larger request
_OK = grpc.StatusCode.OK.value[0]
SEND_JOINED_BYTES = 64 << 10  # a smaller answer is copied behind its head (one send call either way)


class LaneAbort(Exception):
    """A coroutine handler ended its call with a status (``LaneContext.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


class LaneContext:
    """What a servicer method reached through the lane may use of its context: ``abort``."""

    __slots__ = ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise LaneAbort(code, details)


class _Refused(Exception):
    """A frame the lane will not read (too long, or not a hello first): answered, then the connection ends."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class _PeerGone(Exception):
    """The client closed its connection while its call waited on the loop (the call was cancelled)."""


class LocalLaneServer:
    """Serves ``handlers`` (method kind -> handler of the request bytes) on an abstract Unix socket."""

    def __init__(self, handlers: Mapping[int, Handler], *, metrics=None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        unknown = set(handlers) - set(METHODS)
        if unknown:
            raise ValueError(f"no lane method of kind(s) {sorted(unknown)}")
        self.handlers = dict(handlers)
        self._on_loop = {kind for kind, handler in handlers.items() if inspect.iscoroutinefunction(handler)}
        self.metrics = metrics
        self.max_connections = max_connections
        self.name = f"gear.lane.{os.getpid()}.{secrets.token_hex(8)}"
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._unauthenticated = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no call is being answered
        self._in_call = 0
        self._closed = False
        self._refusals = RefusalLog(log)

    def start(self) -> bool:
        """Listen and accept on a thread; False where abstract Unix sockets are not available."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.name)
            listener.listen(64)
        except OSError as e:
            listener.close()
            log.info("no local lane (%s): same-host clients use gRPC for every call", e)
            return False
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="gear-lane-accept", daemon=True).start()
        return True

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop accepting and end every connection; wait up to ``wait_s`` for the calls being answered
        (an acknowledged call is applied before the daemon's final checkpoint). Idempotent."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            connections = list(self._connections)
        if listener is not None:
            _shutdown(listener)
            listener.close()
        for conn in connections:
            _shutdown(conn, socket.SHUT_RD)  # its thread reads EOF once the call in hand is answered
        with self._idle:
            self._idle.wait_for(lambda: self._in_call == 0, wait_s)

    @property
    def connections(self) -> int:
        return len(self._connections)

    # ------------------------------------------------------------------ threads
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                admitted = (not self._closed and len(self._connections) < self.max_connections
                            and self._unauthenticated < MAX_UNAUTHENTICATED)
                if admitted:
                    self._connections.add(conn)
                    self._unauthenticated += 1
            if not admitted:
                _answer_and_close(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"the daemon's local lane takes {self.max_connections} connections "
                                  f"({MAX_UNAUTHENTICATED} before their hello)")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="gear-lane", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray(64 << 10)
        authenticated = False
        loop: _CallLoop | None = None  # this connection's, made at its first coroutine call
        try:
            kind, payload, buffer = _read_frame(conn, buffer, MAX_HELLO_BYTES,
                                                deadline=time.monotonic() + HELLO_TIMEOUT_S)
            if kind != HELLO:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "a local lane connection starts with its hello")
            if len(payload) != 1 + SECRET_BYTES or not hmac.compare_digest(bytes(payload[1:]), self.secret):
                raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "wrong local lane secret")
            if payload[0] != VERSION:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"local lane version {payload[0]} (this daemon speaks {VERSION})")
            conn.settimeout(None)
            with self._lock:
                self._unauthenticated -= 1
                authenticated = True
            conn.sendall(frame(_OK))
            while True:
                if len(buffer) > KEEP_BUFFER_BYTES:
                    buffer = bytearray(64 << 10)
                kind, payload, buffer = _read_frame(conn, buffer, MAX_REQUEST_BYTES)
                if kind < 0:
                    return  # the client closed the connection
                started = time.perf_counter()
                with self._lock:
                    self._in_call += 1
                try:
                    if kind in self._on_loop and loop is None:
                        loop = _CallLoop(conn)
                    answer, code = self._call(kind, payload, conn, loop)
                    _send_frame(conn, *answer)
                finally:
                    with self._idle:
                        self._in_call -= 1
                        if not self._in_call:
                            self._idle.notify_all()
                if self.metrics is not None:  # once the client has its answer
                    self.metrics.observe_rpc(METHODS[kind], code, time.perf_counter() - started)
        except _Refused as e:
            self._refusals.info("local lane connection refused: %s", e)
            _answer_and_close(conn, e.code, str(e))
        except (OSError, _PeerGone):
            pass  # the client went away (or the lane closed)
        finally:
            with self._lock:
                self._connections.discard(conn)
                if not authenticated:
                    self._unauthenticated -= 1
            if loop is not None:
                loop.close()
            conn.close()

    def _call(self, kind: int, payload: memoryview, conn: socket.socket,
              loop: _CallLoop | None) -> tuple[tuple[int, bytes], grpc.StatusCode]:
        """The answer of one call (its frame's kind and payload) and its status."""
        handler = self.handlers.get(kind)
        if handler is None:
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, f"no local lane method of kind {kind}")
        try:
            if kind in self._on_loop:
                return (_OK, loop.run(handler, bytes(payload))), grpc.StatusCode.OK
            return (_OK, handler(payload)), grpc.StatusCode.OK
        except _PeerGone:
            if self.metrics is not None:
                self.metrics.observe_rpc(METHODS[kind], grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:  # noqa: BLE001 (a status for the client, as the RPC would end)
            code, message = _status(e, METHODS[kind])
            return (code.value[0], message.encode()), code


class _CallLoop:
    """A connection thread's event loop for its coroutine calls. While a call runs, the client's socket
    is watched for its EOF (readable then: one call at a time, nothing else comes while a call is
    answered), which cancels the call (``_PeerGone``). The watch stays registered from call to call
    (two epoll changes fewer a call); a wake that was not an EOF drops it until the next call."""

    def __init__(self, conn: socket.socket):
        self.loop = asyncio.new_event_loop()
        self.conn = conn
        self.task: asyncio.Task | None = None
        self.gone = False
        self.watching = False

    def _readable(self) -> None:
        self.loop.remove_reader(self.conn.fileno())  # bytes that are not an EOF are the next read's error
        self.watching = False
        if _peer_gone(self.conn):
            self.gone = True
            if self.task is not None:
                self.task.cancel()

    def run(self, handler: Callable, request: bytes) -> bytes:
        """A coroutine handler's answer, run on this loop; ``_PeerGone`` when the client left meanwhile."""
        task = self.task = self.loop.create_task(handler(request, LaneContext()))
        if not self.watching:
            self.loop.add_reader(self.conn.fileno(), self._readable)
            self.watching = True
        try:
            return self.loop.run_until_complete(task)
        except asyncio.CancelledError:
            if self.gone:
                raise _PeerGone from None
            raise LaneAbort(grpc.StatusCode.CANCELLED, "the call was cancelled") from None
        finally:
            self.task = None

    def close(self) -> None:
        self.loop.close()  # its selector with it (the watch ends there)


def _status(error: BaseException, method: str | None) -> tuple[grpc.StatusCode, str]:
    """The status of a failed call."""
    if isinstance(error, LaneAbort):
        return error.code, error.details
    if isinstance(error, concurrent.futures.CancelledError):
        return grpc.StatusCode.CANCELLED, "the call was cancelled (the daemon is stopping)"
    status = status_of(error)
    if status is None:
        log.error("local lane call %s failed", method, exc_info=error)
        return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"
    return status


def _peer_gone(conn: socket.socket) -> bool:
    """Whether the client closed the connection (without reading what it sent since)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_frame(conn: socket.socket, buffer: bytearray, limit: int, deadline: float | None = None
                ) -> tuple[int, memoryview, bytearray]:
    """(kind, payload, buffer) of the next frame; kind -1 at a clean end of the connection.

    The payload views ``buffer``, or a larger one made for a larger frame (returned: read the next
    frame into it); it is valid until the next read. ``deadline`` (monotonic): the whole frame must
    be in by then (TimeoutError), however its bytes are spread.
    """

    def before_recv() -> None:
        if deadline is not None:
            conn.settimeout(max(0.001, deadline - time.monotonic()))

    got = 0
    with memoryview(buffer) as view:
        while got < HEAD.size:
            before_recv()
            n = conn.recv_into(view[got:])
            if not n:
                if got:
                    raise ConnectionResetError("the connection ended inside a frame")
                return -1, memoryview(b""), buffer
            got += n
    length, kind = HEAD.unpack_from(buffer)
    if not 1 <= length <= limit:
        raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED if length > limit else grpc.StatusCode.INVALID_ARGUMENT,
                       f"a local lane frame of {length} bytes (at most {limit})")
    total = 4 + length
    if got > total:
        raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "one local lane call at a time per connection")
    if total > len(buffer):
        larger = bytearray(total)
        larger[:got] = buffer[:got]
        buffer = larger
    view = memoryview(buffer)
    while got < total:
        before_recv()
        n = conn.recv_into(view[got:total])
        if not n:
            raise ConnectionResetError("the connection ended inside a frame")
        got += n
    return kind, view[HEAD.size:total], buffer


def _send_frame(conn: socket.socket, kind: int, payload: bytes) -> None:
    """Send one frame; a large payload goes after its head in the same call, not copied behind it first."""
    if len(payload) < SEND_JOINED_BYTES:
        conn.sendall(frame(kind, payload))
        return
    head = HEAD.pack(len(payload) + 1, kind)
    sent = conn.sendmsg((head, payload))
    if sent < len(head):
        conn.sendall(head[sent:])
        sent = len(head)
    if sent < len(head) + len(payload):
        with memoryview(payload) as view:
            conn.sendall(view[sent - len(head):])


def _answer_and_close(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(frame(code.value[0], message.encode()))
    except OSError:
        pass
    finally:
        conn.close()


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass
