"""The stream plane's frames: what a learner and the daemon say on a bulk TCP connection.

A connection opens with a ``HELLO`` (magic, role, the session id and its
credential, fixed size) and the daemon's ``ANSWER`` (status 0: bound to that
session). A writer's connection (role ``ROLE_WRITER``, bound to its InsertPlane
stream) then sends per item a ``WRITE`` header (table name length, window count,
slot, layout version), the table name, the windows as ``int64 [n, 2]`` rows
``(segment offset, length)`` and their bytes; the daemon receives them into the
reserved slot and answers each with an ``ANSWER`` (in order). A learner's
connection sends, per batch part, a ``READ`` header (lease,
layout version, window count) followed by the windows as ``int64 [n, 3]`` rows
``(slot, segment offset, length)``, and the daemon answers with an ``ANSWER``
(status 0 and the payload's byte count, then the windows' bytes back to back in
the order asked) or an error status and its message (the connection stays
usable). Everything is little-endian; no pickle, no protobuf on this path.
"""

from __future__ import annotations

import socket
import ssl
import struct

import numpy as np

MAGIC = b"GEARSTR1"
ROLE_LEARNER = 1
ROLE_WRITER = 2
SESSION_ID_BYTES = 32  # secrets.token_hex(16)
CREDENTIAL_BYTES = 32
HELLO = struct.Struct(f"<8sB3x{SESSION_ID_BYTES}s{CREDENTIAL_BYTES}s")
READ = struct.Struct("<4sIQq")  # b"READ", windows, lease id, layout version
READ_MAGIC = b"READ"
WRITE = struct.Struct("<4sHHqq")  # b"WRIT", table name bytes, windows, slot, layout version
WRITE_MAGIC = b"WRIT"
MAX_WRITE_WINDOWS = 4096  # columns of one item
MAX_TABLE_NAME = 1024
ANSWER = struct.Struct("<4sIQ")  # b"GEAR", status, payload bytes (status OK) or message bytes
ANSWER_MAGIC = b"GEAR"
WINDOW_DTYPE = np.dtype("<i8")
WINDOW_BYTES = 3 * WINDOW_DTYPE.itemsize
MAX_WINDOWS = 1 << 16  # per READ (a learner splits larger parts)
MAX_MESSAGE = 4096
IOV_MAX = 1024  # buffers one sendmsg / recvmsg_into takes (Linux's UIO_MAXIOV)

# ANSWER statuses
OK = 0
REFUSED = 1  # unknown session or wrong credential (the connection is closed)
LEASE_GONE = 2  # the lease expired or was released: nothing sent, the batch is stale
OUT_OF_BOUNDS = 3  # a window outside a leased slot's bytes or the segment
BAD_REQUEST = 4  # malformed header, too many windows, an unknown table
BUSY = 5  # the session already has its connections, or the daemon its most
LAYOUT_GONE = 6  # a layout version the session does not hold (never sent, or the table moved on since)
STATUS_NAMES = {OK: "ok", REFUSED: "refused", LEASE_GONE: "lease gone", OUT_OF_BOUNDS: "out of bounds",
                BAD_REQUEST: "bad request", BUSY: "busy", LAYOUT_GONE: "layout gone"}


class StreamProtocolError(ConnectionError):
    """The peer broke the stream protocol (bad magic, a frame cut short): the connection is dropped."""


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``recv_into`` straight into it); StreamProtocolError on an early EOF.

    Plain sockets wait for the whole view in one call (``MSG_WAITALL``): the thread takes the GIL
    back once per window instead of once per segment the kernel hands over, which behind a busy
    interpreter (the daemon's event loop) cost up to a switch interval each.
    """
    got = 0
    total = len(view)
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < total:
        n = sock.recv_into(view[got:], total - got, flags)
        if n == 0:
            raise StreamProtocolError(f"the peer closed the connection after {got} of {total} bytes")
        got += n


def recv_scatter(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill each of ``views`` in order from ``sock``: one ``recvmsg_into`` for all of them on a plain socket
    (a syscall, and a GIL round trip, per item instead of per window); StreamProtocolError on an early EOF."""
    views = [v for v in views if len(v)]
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            recv_exact(sock, view)
        return
    while views:
        n = sock.recvmsg_into(views[:IOV_MAX], 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise StreamProtocolError("the peer closed the connection mid-frame")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def send_gather(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send ``buffers`` back to back: ``sendmsg`` on a plain socket (one syscall while the kernel takes it all)."""
    buffers = [b for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        for b in buffers:
            sock.sendall(b)
        return
    while buffers:
        n = sock.sendmsg(buffers[:IOV_MAX])
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        if n:
            buffers[0] = buffers[0][n:]


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def hello(session_id: str, credential: bytes, role: int = ROLE_LEARNER) -> bytes:
    sid = session_id.encode()
    if len(sid) != SESSION_ID_BYTES or len(credential) != CREDENTIAL_BYTES:
        raise ValueError("a stream hello needs a 32-character session id and a 32-byte credential")
    return HELLO.pack(MAGIC, role, sid, credential)


def parse_hello(data: bytes) -> tuple[int, str, bytes]:
    """(role, session id, credential); StreamProtocolError for anything but a hello."""
    magic, role, sid, credential = HELLO.unpack(data)
    if magic != MAGIC:
        raise StreamProtocolError("not a gear stream connection (bad magic)")
    return role, sid.decode(errors="replace"), credential


def answer(status: int, size: int = 0) -> bytes:
    return ANSWER.pack(ANSWER_MAGIC, status, size)


def error_answer(status: int, message: str) -> bytes:
    text = message.encode()[:MAX_MESSAGE]
    return ANSWER.pack(ANSWER_MAGIC, status, len(text)) + text


def read_answer(sock: socket.socket) -> tuple[int, int, str]:
    """(status, payload bytes, error message) of the daemon's next ANSWER."""
    magic, status, size = ANSWER.unpack(recv_bytes(sock, ANSWER.size))
    if magic != ANSWER_MAGIC:
        raise StreamProtocolError("the daemon's answer has a bad magic (not a gear stream, or out of step)")
    if status == OK:
        return status, size, ""
    if size > MAX_MESSAGE:
        raise StreamProtocolError(f"error message of {size} bytes")
    return status, 0, recv_bytes(sock, size).decode(errors="replace")


def read_request(lease_id: int, layout_version: int, windows: np.ndarray) -> bytes:
    """A READ of ``windows`` (``[n, 3]`` slot, segment offset, length) under ``lease_id``."""
    w = np.ascontiguousarray(windows, dtype=WINDOW_DTYPE)
    if w.ndim != 2 or w.shape[1] != 3 or len(w) > MAX_WINDOWS:
        raise ValueError(f"a READ carries [n <= {MAX_WINDOWS}, 3] windows, got shape {w.shape}")
    return READ.pack(READ_MAGIC, len(w), int(lease_id), int(layout_version)) + w.tobytes()


def write_request(table: str, slot: int, layout_version: int, windows: np.ndarray) -> bytes:
    """A WRITE header, table name and ``windows`` (``[n, 2]`` segment offset, length); the bytes follow."""
    name = table.encode()
    w = np.ascontiguousarray(windows, dtype=WINDOW_DTYPE)
    if len(name) > MAX_TABLE_NAME or w.ndim != 2 or w.shape[1] != 2 or len(w) > MAX_WRITE_WINDOWS:
        raise ValueError(f"a WRITE carries a table name of <= {MAX_TABLE_NAME} bytes and [n <= {MAX_WRITE_WINDOWS}, 2] "
                         f"windows, got {len(name)} bytes and shape {w.shape}")
    return WRITE.pack(WRITE_MAGIC, len(name), len(w), int(slot), int(layout_version)) + name + w.tobytes()
