"""A writer on another host: the rows of its reserved slots go to the daemon on a stream connection.

``SlotWriter`` (gear_contract.slot_writer) reserves and commits over its
InsertPlane stream as on the daemon's host; what differs is where the rows go.
On the daemon's host they are copied into the mapped segment; from another host
``RowSender`` sends them on one TCP connection of the stream plane (a WRITE per
item, gear_contract.stream_frames) and the daemon receives them straight into
the slot. Each WRITE is answered in order; an item is committed only once its
answer says the rows are in, so a commit never exposes a slot still being
received. ``StreamSlotMapping`` is the remote twin of ``SegmentWriterMapping``:
it keeps a copy of each item's rows (in a reused buffer, sent from there) until its commit is acknowledged, so an item
whose stream fails can be sent again another way (InsertStream; keys are
idempotent) and a table that moved to a new segment gets them again.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from gear_contract import stream_frames as frames
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

CONNECT_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 30.0
KEPT_BUFFER_BYTES = 64 << 20  # free row buffers a writer keeps for its next items

RowsDone = Callable[[int, str], None]  # (the daemon's status, its message when not OK; -1: the connection failed)


class RowSender:
    """One row connection to the daemon (role writer); answers are read on its own thread, in order."""

    def __init__(self, host: str, endpoint: pb.StreamEndpoint, ssl_context: ssl.SSLContext | None = None):
        credential = bytes(endpoint.credential)
        if len(credential) != frames.SESSION_ID_BYTES + frames.CREDENTIAL_BYTES:
            raise ValueError("the daemon's insert stream endpoint has a malformed credential")
        host = endpoint.host or host
        sock = socket.create_connection((host, endpoint.port), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            sock.sendall(frames.hello(credential[:frames.SESSION_ID_BYTES].decode(),
                                      credential[frames.SESSION_ID_BYTES:], frames.ROLE_WRITER))
            status, _, message = frames.read_answer(sock)
            if status != frames.OK:
                raise ConnectionRefusedError(message or "the daemon refused the row connection")
            sock.settimeout(IO_TIMEOUT_S)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: deque[RowsDone] = deque()
        self.error: BaseException | None = None
        self.buffers = RowBuffers()
        self._reader = threading.Thread(target=self._read, name="gear-insert-rows", daemon=True)
        self._reader.start()

    def send(self, table: str, slot: int, version: int, windows: np.ndarray, rows: Sequence[np.ndarray],
             done: RowsDone) -> None:
        """Send one item's rows (``windows`` ``[n, 2]``: segment offset, length; ``rows`` their bytes in order);
        ``done`` is called once the daemon answered (or the connection failed)."""
        with self._send_lock:
            with self._lock:
                if self.error is not None:
                    raise ConnectionError(f"the row connection failed: {self.error}")
                self._waiting.append(done)
            try:  # the header and the rows in one gathered send
                frames.send_gather(self._sock, [memoryview(frames.write_request(table, slot, version, windows))]
                                   + [memoryview(np.ascontiguousarray(r)).cast("B") for r in rows if r.nbytes])
            except OSError as exc:
                self._fail(exc)
                raise ConnectionError(f"the row connection failed: {exc}") from exc

    def _read(self) -> None:
        try:
            while True:
                status, _, message = frames.read_answer(self._sock)
                with self._lock:
                    done = self._waiting.popleft() if self._waiting else None
                if done is None:
                    raise frames.StreamProtocolError("an answer for no WRITE")
                done(status, message)
        except (OSError, frames.StreamProtocolError, ValueError) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
            waiting, self._waiting = list(self._waiting), deque()
        for done in waiting:
            done(-1, f"the row connection failed: {exc}")

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=5)
        self._sock.close()


class RowBuffers:
    """Reused byte buffers for the copies a remote writer keeps until their commits are acknowledged.

    A fresh array per item of a few hundred KiB is an mmap, a page fault on each of its pages and a
    munmap: on a loaded host that cost more than sending the item. Buffers given back are kept (up to
    ``max_bytes`` in all, the oldest dropped first) and handed out again for items of up to their size.
    """

    def __init__(self, max_bytes: int = KEPT_BUFFER_BYTES):
        self.max_bytes = max_bytes
        self._free: deque[np.ndarray] = deque()
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` buffer of at least ``nbytes`` (at most twice that when reused)."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                buf = self._free[i]
                if nbytes <= len(buf) <= 2 * nbytes:
                    del self._free[i]
                    self._kept -= len(buf)
                    return buf
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            self._kept += len(buf)
            while self._kept > self.max_bytes:
                self._kept -= len(self._free.popleft())

    @property
    def kept_bytes(self) -> int:
        return self._kept


class _SentItem(NamedTuple):
    """An item's rows as sent: one buffer, per column (start, bytes, dtype, shape) in it."""

    buf: np.ndarray
    columns: list[tuple[int, int, np.dtype, tuple[int, ...]]]


class StreamSlotMapping:
    """One layout version of a table as a remote writer sees it: rows go out on a ``RowSender``."""

    remote = True

    def __init__(self, layout: TableLayout, sender: RowSender, table: str):
        self.layout = layout
        self._sender = sender
        self._table = table
        self._rows: dict[int, _SentItem] = {}  # slot -> its rows, until the commit is acknowledged

    def claim(self, slots: Sequence[int]) -> list[int]:
        return []  # nothing to map here

    def populate(self, slots: Sequence[int]) -> None:
        """Nothing to map on this side."""

    def write_async(self, slot: int, columns: Sequence[Sequence[np.ndarray]], done: RowsDone) -> None:
        """Send an item's rows (per column, pieces of ``[t, *shape]``) into ``slot``; keeps a copy until ``forget``.

        The pieces are copied once, back to back into one reused buffer (the copy a resend needs), and
        that buffer goes to the socket as it is: the header and the rows in one ``sendmsg``.
        """
        sizes = [sum(p.nbytes for p in pieces) for pieces in columns]
        total = sum(sizes)
        buf = self._sender.buffers.take(total)
        kept, windows, pos = [], [], 0
        for col, pieces, size in zip(self.layout.columns, columns, sizes, strict=True):
            first = pieces[0]
            steps = sum(len(p) for p in pieces)
            shape = (steps, *first.shape[1:])
            dst = buf[pos:pos + size].view(first.dtype).reshape(shape)
            at = 0
            for p in pieces:
                np.copyto(dst[at:at + len(p)], p)
                at += len(p)
            kept.append((pos, size, first.dtype, shape))
            if size:
                windows.append((col.slot_offset(slot), size))
            pos += size
        self._rows[slot] = _SentItem(buf, kept)
        self._sender.send(self._table, slot, self.layout.version,
                          np.array(windows, dtype=np.int64).reshape(-1, 2), [buf[:total]], done)

    def rows(self, slot: int, lengths: Sequence[int]) -> list[np.ndarray]:
        """The rows sent into ``slot`` (its first ``lengths[c]`` steps per column), copied out."""
        item = self._rows[slot]
        return [np.array(item.buf[start:start + size].view(dtype).reshape(shape)[:n])
                for (start, size, dtype, shape), n in zip(item.columns, lengths, strict=True)]

    def forget(self, slot: int) -> None:
        item = self._rows.pop(slot, None)
        if item is not None:
            self._sender.buffers.give(item.buf)
