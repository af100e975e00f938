"""The stream plane's daemon side: learners on other hosts read leased windows over TCP, sent with sendfile.

``StreamServer`` owns one listening socket. A session negotiated as ``stream``
gets a ``StreamGrant``: a random credential bound to it and the segment files of
the layouts it was sent (each opened once, read-only, and closed only when no
connection uses it, so an fd number is never reused under a send). The learner
opens up to ``connections`` TCP connections and presents the session id and
credential (``gear_contract.stream_frames``); each connection gets its own thread
(blocking I/O releases the GIL; nothing runs on the control plane's event loop).

Every READ is checked before a byte moves: the lease must be one the session
holds now, every window's slot one of that lease's slots, the window inside one
column's bytes of that slot and inside the segment. Anything else is refused
with a status and a message, and nothing is read. The bytes go from the segment's
file to the socket with ``os.sendfile`` (no copy through Python); over TLS they
are read with ``preadv`` into one reused buffer and sent through the SSL socket.

Bounded resources: at most ``max_connections`` connections (and 32 unauthenticated
ones, each with a handshake timeout), ``connections`` per session; a learner that
stops reading stalls a send for at most ``stall_timeout_s`` before its connection
is dropped; closing or reaping the session shuts its connections down; a session
whose connections have all gone after it had some is closed (its leases end).
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gear_contract import stream_frames as frames
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_HANDSHAKES = 32
LAYOUTS_KEPT = 4  # segment files a session keeps open at most (the newest layouts it was sent)
TLS_CHUNK = 1 << 20
MAX_WRITE_BYTES = 1 << 31  # rows of one WRITE
MADV_POPULATE_WRITE = 23  # Linux 5.14+
MAX_POPULATED_RANGES = 1 << 20  # ranges a writable mapping remembers as populated
_populate_write = True  # False once the kernel refused it
SENDFILE_CHUNK = 1 << 30


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class SegmentFile:
    """A segment file opened read-only for one layout; closed once closed and no send uses it."""

    def __init__(self, layout: TableLayout, writable: bool = False):
        self.layout = layout
        self.fd = os.open(layout.segment, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        self.size = min(layout.segment_size, os.fstat(self.fd).st_size)
        self.view: memoryview | None = None  # writable: the whole segment, mapped read-write
        self._mmap: mmap.mmap | None = None
        if writable:
            try:
                self._mmap = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(self.fd)
                raise
            self.view = memoryview(self._mmap)
        self._users = 0
        self._closing = False
        self._lock = threading.Lock()
        self._populated: set[tuple[int, int]] = set()  # ranges populated in this mapping

    def populate(self, offset: int, length: int) -> None:
        """Writable: map the pages of ``[offset, offset + length)`` now, one call (``MADV_POPULATE_WRITE``,
        Linux 5.14+) instead of a fault per page while the rows come in; only those pages are allocated.

        A range is populated once per mapping (slots are written again and again; a page the daemon
        freed meanwhile faults in as it is written)."""
        global _populate_write
        if self._mmap is None or not _populate_write or (offset, length) in self._populated:
            return
        if len(self._populated) < MAX_POPULATED_RANGES:
            self._populated.add((offset, length))
        start = offset - offset % mmap.PAGESIZE
        end = min(self.size, -(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE)
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE, start, end - start)
        except (OSError, ValueError):
            _populate_write = False  # an older kernel: pages fault in as they are written

    def acquire(self) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._closing and self._users == 0
        if last:
            self._free()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            last = self._users == 0
        if last:
            self._free()

    def _free(self) -> None:
        if self.view is not None:
            self.view.release()
            self._mmap.close()
        os.close(self.fd)


@dataclass
class WriteHooks:
    """How a writer's connection asks its InsertPlane stream about a WRITE (gear_server.ingest.plane_service).

    ``begin(table, slot, version)`` returns the layout to write into and marks the slot as being
    written (its reservation cannot time out meanwhile), or raises WindowRefused; ``end(table, slot)``
    ends that mark.
    """

    begin: Callable[[str, int, int], TableLayout]
    end: Callable[[str, int], None]


@dataclass
class StreamGrant:
    """One session's right to stream: its credential, connections and open segment files."""

    session_id: str
    credential: bytes
    max_connections: int
    role: int = frames.ROLE_LEARNER
    writer: WriteHooks | None = None  # a writer's: which slots it may write
    connections: set[socket.socket] = field(default_factory=set)
    files: OrderedDict[Any, SegmentFile] = field(default_factory=OrderedDict)
    had_connections: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    superseded_at: dict[Any, float] = field(default_factory=dict)  # layout -> when a newer one was attached

    def segment(self, version: int, retire_after_s: float) -> SegmentFile | None:
        """The open file of layout ``version``, acquired (release it); None if this session holds no such layout.

        Files of layouts superseded more than ``retire_after_s`` ago are closed first: every lease
        selected under them has ended by then, and an old segment's memory is not held for nothing.
        """
        now = time.monotonic()
        with self.lock:
            for old in [v for v, t in self.superseded_at.items() if now - t > retire_after_s]:
                del self.superseded_at[old]
                retired = self.files.pop(old, None)
                if retired is not None:
                    retired.close()
            seg = self.files.get(version)
        return seg if seg is not None and seg.acquire() else None


class WindowRefused(Exception):
    """A READ the daemon refuses (status and message go back to the learner)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class StreamServer:
    """The listener and connection threads of the stream plane (see module docstring)."""

    def __init__(self, *, bind_host: str, port: int = 0, advertise_host: str = "", connections: int = 4,
                 ssl_context: ssl.SSLContext | None = None, stall_timeout_s: float = 30.0,
                 idle_timeout_s: float = 600.0, max_connections: int = 1024):
        self.connections_per_session = int(connections)
        self.advertise_host = advertise_host
        self.ssl_context = ssl_context
        self.stall_timeout_s = float(stall_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_connections = int(max_connections)
        # a superseded layout's file is closed this long after the newer one was sent (the lease timeout)
        self.retire_after_s = 60.0
        # (session id, lease id) -> the lease's slots, or None when the session does not hold it (set by the manager)
        self.lease_slots: Callable[[str, int], np.ndarray | None] = lambda sid, lease: None
        self.on_lost: Callable[[str], None] = lambda sid: None  # a session's last connection went away
        self._grants: dict[str, StreamGrant] = {}
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._open_connections = 0
        self._pending = 0
        self._stop = threading.Event()
        host = bind_host.strip("[]") if bind_host else ""
        if host in ("", "::", "0.0.0.0"):
            family, host = (socket.AF_INET6, "::") if socket.has_ipv6 and host != "0.0.0.0" else (socket.AF_INET, "")
        else:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and host == "::":
                self._listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self._listener.bind((host, port))
            self._listener.listen(128)
            self._listener.settimeout(0.5)
        except BaseException:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="gear-stream-accept", daemon=True)
        self._acceptor.start()

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    # ------------------------------------------------------------------ sessions
    def grant(self, session_id: str) -> StreamGrant:
        """A new credential for ``session_id`` (valid until ``close_session``)."""
        grant = StreamGrant(session_id, secrets.token_bytes(frames.CREDENTIAL_BYTES), self.connections_per_session)
        with self._lock:
            self._grants[session_id] = grant
        return grant

    def grant_writer(self, hooks: WriteHooks) -> StreamGrant:
        """A credential for one InsertPlane stream's row connection (valid until ``close_session``)."""
        grant = StreamGrant(secrets.token_hex(frames.SESSION_ID_BYTES // 2),
                            secrets.token_bytes(frames.CREDENTIAL_BYTES), self.connections_per_session,
                            role=frames.ROLE_WRITER, writer=hooks)
        with self._lock:
            self._grants[grant.session_id] = grant
        return grant

    def writer_endpoint(self, grant: StreamGrant) -> pb.StreamEndpoint:
        """The endpoint of a writer's grant: ``host`` carries nothing, the grant's id goes in the credential's
        place of the learner's session id (``credential`` = id bytes + secret)."""
        return pb.StreamEndpoint(host=self.advertise_host, port=self.port,
                                 credential=grant.session_id.encode() + grant.credential,
                                 connections=grant.max_connections, tls=self.tls)

    def endpoint(self, grant: StreamGrant) -> pb.StreamEndpoint:
        return pb.StreamEndpoint(host=self.advertise_host, port=self.port, credential=grant.credential,
                                 connections=grant.max_connections, tls=self.tls)

    def attach(self, grant: StreamGrant, layout: TableLayout) -> None:
        """Open ``layout``'s segment file for the session (FileNotFoundError: the table moved on meanwhile)."""
        with grant.lock:
            if layout.version in grant.files or grant.closed:
                return
        seg = SegmentFile(layout)
        with grant.lock:
            if layout.version in grant.files or grant.closed:
                seg.close()
                return
            now = time.monotonic()
            for older in grant.files:
                grant.superseded_at.setdefault(older, now)
            grant.files[layout.version] = seg
            while len(grant.files) > LAYOUTS_KEPT:
                old, retired = grant.files.popitem(last=False)
                grant.superseded_at.pop(old, None)
                retired.close()

    def close_session(self, grant: StreamGrant) -> None:
        """Forget the credential, shut the session's connections down and close its files (once unused)."""
        with self._lock:
            self._grants.pop(grant.session_id, None)
        with grant.lock:
            grant.closed = True
            conns = list(grant.connections)
            files = list(grant.files.values())
            grant.files.clear()
        for conn in conns:
            _shutdown(conn)
        for seg in files:
            seg.close()

    def close(self) -> None:
        """Stop accepting, shut every connection down and wait (briefly) for their threads. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._acceptor.join(timeout=2)
        self._listener.close()
        with self._lock:
            grants = list(self._grants.values())
            threads = list(self._threads)
        for grant in grants:
            self.close_session(grant)
        for t in threads:
            t.join(timeout=2)

    def connection_count(self) -> int:
        with self._lock:
            return self._open_connections

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                full = (self._open_connections >= self.max_connections or self._pending >= MAX_PENDING_HANDSHAKES)
                if not full:
                    self._open_connections += 1
                    self._pending += 1
            if full:
                log.warning("stream plane: refusing a connection from %s (connection limit reached)", peer)
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn, peer), name="gear-stream-conn", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        grant: StreamGrant | None = None
        pending = True
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            grant = self._handshake(conn)
            with self._lock:
                self._pending -= 1
                pending = False
            if grant is None:
                return
            self._configure(conn)
            serve = self._serve_write if grant.role == frames.ROLE_WRITER else self._serve_read
            while not self._stop.is_set():
                serve(conn, grant)
        except (OSError, frames.StreamProtocolError, ssl.SSLError, ValueError, struct.error) as exc:
            log.debug("stream connection from %s ended: %s", peer, exc)
        except Exception:  # noqa: BLE001 - one connection's failure must not take the daemon down
            log.exception("stream connection from %s failed", peer)
        finally:
            lost = False
            if grant is not None:
                with grant.lock:
                    grant.connections.discard(conn)
                    lost = grant.had_connections and not grant.connections and not grant.closed
            _shutdown(conn)
            conn.close()
            with self._lock:
                self._open_connections -= 1
                if pending:
                    self._pending -= 1
                self._threads.discard(threading.current_thread())
            if lost and not self._stop.is_set():
                self.on_lost(grant.session_id)

    def _handshake(self, conn: socket.socket) -> StreamGrant | None:
        role, session_id, credential = frames.parse_hello(frames.recv_bytes(conn, frames.HELLO.size))
        with self._lock:
            grant = self._grants.get(session_id)
        if grant is None or role != grant.role or not hmac.compare_digest(credential, grant.credential):
            conn.sendall(frames.error_answer(frames.REFUSED, "stream refused: unknown session or wrong credential"))
            return None
        with grant.lock:
            if grant.closed:
                busy = "the session is closed"
            elif len(grant.connections) >= grant.max_connections:
                busy = f"the session already has its {grant.max_connections} connections"
            else:
                busy = ""
                grant.connections.add(conn)
                grant.had_connections = True
        if busy:
            conn.sendall(frames.error_answer(frames.BUSY, f"stream refused: {busy}"))
            return None
        conn.sendall(frames.answer(frames.OK))
        return grant

    def _configure(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_context is not None:  # SSL sockets keep Python's timeout (one for both directions)
            conn.settimeout(self.stall_timeout_s)
            return
        conn.settimeout(None)  # blocking, so sendfile blocks (GIL released); the kernel bounds each wait
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.idle_timeout_s))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.stall_timeout_s))

    def _serve_read(self, conn: socket.socket, grant: StreamGrant) -> None:
        """One READ: header, windows, checks, then the bytes (or a refusal)."""
        magic, count, lease_id, version = frames.READ.unpack(frames.recv_bytes(conn, frames.READ.size))
        if magic != frames.READ_MAGIC:
            raise frames.StreamProtocolError("expected a READ header")
        if count > frames.MAX_WINDOWS:
            conn.sendall(frames.error_answer(frames.BAD_REQUEST,
                                             f"{count} windows in one READ; at most {frames.MAX_WINDOWS}"))
            raise frames.StreamProtocolError("too many windows")
        windows = np.empty((count, 3), dtype=frames.WINDOW_DTYPE)
        frames.recv_exact(conn, memoryview(windows).cast("B"))
        seg = None
        try:
            seg = self._check(grant, lease_id, version, windows)
        except WindowRefused as refused:
            conn.sendall(frames.error_answer(refused.status, str(refused)))
            return
        try:
            runs = _runs(windows[:, 1], windows[:, 2])
            conn.sendall(frames.answer(frames.OK, int(windows[:, 2].sum())))
            if self.ssl_context is None:
                _sendfile_all(conn, seg.fd, runs)
            else:
                _send_copied(conn, seg.fd, runs)
        finally:
            seg.release()

    def _check(self, grant: StreamGrant, lease_id: int, version: int, windows: np.ndarray) -> SegmentFile:
        """The acquired segment file to send ``windows`` from, or WindowRefused saying why not."""
        slots = self.lease_slots(grant.session_id, lease_id)
        if slots is None:
            raise WindowRefused(frames.LEASE_GONE, f"lease {lease_id} is not held (expired or released)")
        seg = grant.segment(version, self.retire_after_s)
        if seg is None:
            raise WindowRefused(frames.LAYOUT_GONE, f"layout version {version} is not one this session holds")
        try:
            _check_windows(seg, slots, windows)
        except WindowRefused:
            seg.release()
            raise
        return seg


    def _serve_write(self, conn: socket.socket, grant: StreamGrant) -> None:
        """One WRITE: header, table, windows, then the rows received straight into the reserved slot."""
        magic, name_len, count, slot, version = frames.WRITE.unpack(frames.recv_bytes(conn, frames.WRITE.size))
        if magic != frames.WRITE_MAGIC:
            raise frames.StreamProtocolError("expected a WRITE header")
        if name_len > frames.MAX_TABLE_NAME or count > frames.MAX_WRITE_WINDOWS:
            raise frames.StreamProtocolError(f"a WRITE of {count} windows for a {name_len}-byte table name")
        name = bytearray(name_len)
        raw = np.empty((count, 2), dtype=frames.WINDOW_DTYPE)
        frames.recv_scatter(conn, [memoryview(name), memoryview(raw).cast("B")])  # one receive for both
        table = name.decode(errors="replace")
        windows = raw.tolist()  # an item's few windows: plain ints are cheaper to check than arrays
        total = sum(length for _, length in windows)
        if any(length < 0 for _, length in windows) or total > MAX_WRITE_BYTES:
            raise frames.StreamProtocolError("a WRITE of negative or more than 2 GiB of rows")
        try:
            layout = grant.writer.begin(table, int(slot), int(version))
        except WindowRefused as refused:
            _drain(conn, total)  # the rows follow the header: read past them, keep the connection in step
            conn.sendall(frames.error_answer(refused.status, str(refused)))
            return
        try:
            try:
                target = self._write_target(grant, table, layout)
            except FileNotFoundError:  # the table grew between the check and the open: its file has a new name
                _drain(conn, total)
                conn.sendall(frames.error_answer(frames.LAYOUT_GONE, f"table '{table}' moved to a new segment "
                                                                     "while its rows came; resend for the new one"))
                return
            try:
                _check_slot_windows(target, int(slot), windows)
                if windows:
                    first = min(offset for offset, _ in windows)
                    target.populate(first, max(offset + length for offset, length in windows) - first)
                frames.recv_scatter(conn, [target.view[offset:offset + length] for offset, length in windows])
            except WindowRefused as refused:
                _drain(conn, total)
                conn.sendall(frames.error_answer(refused.status, str(refused)))
                return
            finally:
                target.release()
        finally:
            grant.writer.end(table, int(slot))
        conn.sendall(frames.answer(frames.OK))

    def _write_target(self, grant: StreamGrant, table: str, layout: TableLayout) -> SegmentFile:
        """The segment of ``layout`` mapped read-write for this writer, acquired (release it)."""
        key = (table, layout.version)
        while True:
            with grant.lock:
                target = grant.files.get(key)
            if target is None:
                target = SegmentFile(layout, writable=True)
                with grant.lock:
                    if grant.closed:
                        target.close()
                        raise OSError("the writer's stream ended")
                    grant.files.setdefault(key, target)
                    if grant.files[key] is not target:
                        target.close()
                        continue
                    # rows go into a table's current layout only: older mappings of that table close
                    # (each once the receive into it, if any, has ended)
                    for older in [k for k in grant.files if k[0] == table and k[1] < layout.version]:
                        grant.files.pop(older).close()
            if target.acquire():
                return target


def _drain(conn: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (rows of a refused WRITE), one reused buffer."""
    buf = bytearray(min(nbytes, TLS_CHUNK) or 1)
    view = memoryview(buf)
    while nbytes > 0:
        n = conn.recv_into(view[:min(nbytes, len(buf))])
        if n == 0:
            raise frames.StreamProtocolError("the writer closed the connection mid-item")
        nbytes -= n


def _check_windows(seg: SegmentFile, leased: np.ndarray, windows: np.ndarray) -> None:
    """WindowRefused unless every window lies in one column's bytes of a leased slot, inside the segment."""
    if not len(windows):
        return
    slots, offsets, lengths = windows[:, 0], windows[:, 1], windows[:, 2]
    if (lengths <= 0).any() or (offsets < 0).any() or (lengths > seg.size).any() or (offsets > seg.size).any():
        raise WindowRefused(frames.OUT_OF_BOUNDS, "a window has a negative offset, no length or lies past the segment")
    if (offsets + lengths > seg.size).any():
        raise WindowRefused(frames.OUT_OF_BOUNDS, f"a window ends past the segment ({seg.size} bytes)")
    if not np.isin(slots, leased).all():
        bad = int(slots[~np.isin(slots, leased)][0])
        raise WindowRefused(frames.OUT_OF_BOUNDS, f"slot {bad} is not leased by this READ's lease (or reserved by "
                                                  "this writer)")
    inside = np.zeros(len(windows), dtype=bool)
    for col in seg.layout.columns:
        start = col.offset + slots * col.slot_stride
        inside |= (offsets >= start) & (offsets + lengths <= start + col.max_length * col.step_bytes)
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        raise WindowRefused(frames.OUT_OF_BOUNDS, f"window {i} (offset {int(offsets[i])}, {int(lengths[i])} bytes) "
                                                  f"is not inside slot {int(slots[i])}'s bytes of one column")


def _check_slot_windows(seg: SegmentFile, slot: int, windows: list[list[int]]) -> None:
    """WindowRefused unless every ``(offset, length)`` lies in one column's bytes of ``slot``, inside the segment
    (a writer's item: a window per column, checked with plain ints)."""
    extents = [(col.offset + slot * col.slot_stride, col.max_length * col.step_bytes) for col in seg.layout.columns]
    for i, (offset, length) in enumerate(windows):
        if length <= 0 or offset < 0 or offset + length > seg.size:
            raise WindowRefused(frames.OUT_OF_BOUNDS, f"window {i} (offset {offset}, {length} bytes) is empty, "
                                                      "negative or past the segment")
        if not any(start <= offset and offset + length <= start + extent for start, extent in extents):
            raise WindowRefused(frames.OUT_OF_BOUNDS, f"window {i} (offset {offset}, {length} bytes) is not inside "
                                                      f"slot {slot}'s bytes of one column")


def _runs(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """The windows as (offset, length) runs, consecutive windows adjacent in the file merged (order kept)."""
    if not len(offsets):
        return []
    ends = offsets[:-1] + lengths[:-1]
    heads = np.concatenate(([True], offsets[1:] != ends))
    group = np.cumsum(heads) - 1
    starts = offsets[heads]
    sizes = np.bincount(group, weights=lengths, minlength=len(starts)).astype(np.int64)
    return list(zip(starts.tolist(), sizes.tolist(), strict=True))


def _sendfile_all(conn: socket.socket, fd: int, runs: list[tuple[int, int]]) -> None:
    out = conn.fileno()
    for offset, length in runs:
        while length > 0:
            sent = os.sendfile(out, fd, offset, min(length, SENDFILE_CHUNK))
            if sent == 0:
                raise OSError("sendfile sent nothing (the segment is shorter than its layout)")
            offset += sent
            length -= sent


def _send_copied(conn: socket.socket, fd: int, runs: list[tuple[int, int]]) -> None:
    """TLS: read each run into one reused buffer and send it through the SSL socket."""
    buf = bytearray(TLS_CHUNK)
    view = memoryview(buf)
    for offset, length in runs:
        while length > 0:
            n = os.preadv(fd, [view[:min(length, TLS_CHUNK)]], offset)
            if n == 0:
                raise OSError("the segment is shorter than its layout")
            conn.sendall(view[:n])
            offset += n
            length -= n


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str | None = None,
                       require_client_cert: bool = True) -> ssl.SSLContext:
    """The bulk streams' TLS context: the control plane's certificate (and client CA for mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return context


def open_stream_server(settings: Any, bind_host: str, auth: Any = None) -> tuple[StreamServer | None, str | None]:
    """The daemon's stream server per ``[data_planes]`` (``settings``) and ``[auth]`` (TLS), or (None, why not).

    With TLS on the control plane the bulk connections use the same certificate
    unless ``stream_plaintext`` is set. A port that cannot be bound turns the plane
    off (the reason is logged at start); remote learners then read inline.
    """
    if not settings.stream:
        return None, "[data_planes] stream = false"
    context = None
    if auth is not None and getattr(auth, "tls", False) and not settings.stream_plaintext:
        context = server_ssl_context(auth.tls_cert_file, auth.tls_key_file, auth.tls_client_ca_file,
                                     auth.require_client_cert)
    try:
        server = StreamServer(bind_host=settings.stream_bind or bind_host, port=settings.stream_port,
                              advertise_host=settings.stream_advertise or "", connections=settings.stream_connections,
                              ssl_context=context, stall_timeout_s=settings.stream_stall_timeout_s,
                              max_connections=settings.stream_max_connections)
    except OSError as exc:
        return None, f"cannot listen on {settings.stream_bind or bind_host}:{settings.stream_port} ({exc})"
    return server, None
