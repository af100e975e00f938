"""The stream plane: a learner on another host reads its leased items' bytes over TCP connections.

After ``OpenDataPlane`` answers ``stream`` with the daemon's listener and a
per-session credential, the learner opens up to ``connections`` TCP connections
and presents the credential on each (``gear_contract.stream_frames``). For each
batch it plans the byte windows of the selection (``range_planning``, as the
other planes), cuts them into contiguous parts of about equal bytes, one per
connection, and asks each connection for its part under the batch's lease. The
daemon checks the windows against the lease and writes them from the segment's
file with ``sendfile``; each connection's worker thread receives them with
``recv_into`` straight into the batch buffer (page-aligned; pinned with CUDA when
the learner gathers for a GPU, whose copy then goes at the PCIe rate). The
padding is zeroed and the lease released by the sampler; a lease that ended
before the daemon sent anything comes back stale, so the batch is dropped.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from gear_client.data_planes.batch import BufferPool, Pending, SampledBatch, column_arrays
from gear_client.data_planes.plane import PlaneInterrupted
from gear_client.data_planes.projection import ColumnChoice, narrowed
from gear_client.data_planes.range_planning import (
    LENGTH,
    LOCAL,
    REMOTE,
    BatchLayout,
    WindowSpec,
    padding_ranges,
    plan_ranges,
    resolve_windows,
    window_bounds,
    window_steps,
)
from gear_client.data_planes.session import ItemSelection, PlaneSession
from gear_client.data_planes.shm import is_gpu_device
from gear_contract import stream_frames as frames
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0  # no byte for this long on a connection: the plane fails (the sampler re-negotiates)
MIN_PART_BYTES = 1 << 20  # a batch smaller than connections x this uses fewer connections


class StreamPlaneError(RuntimeError):
    """The daemon refused a READ (a window outside the lease or the segment, an unknown layout)."""


class StreamLayoutGone(PlaneInterrupted, StreamPlaneError):
    """The daemon no longer holds the layout a READ addressed (the table moved on meanwhile): a new session
    starts from the table's current layout."""


class StreamConnectionLost(PlaneInterrupted, ConnectionError):
    """A bulk connection broke (the daemon restarted, the network failed): re-negotiating may cure it."""


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def client_ssl_context(security: Any, host: str) -> ssl.SSLContext:
    """TLS for the bulk connections from the control plane's settings (roots, client certificate)."""
    roots = getattr(security, "root_certificates", None)
    context = ssl.create_default_context(cadata=roots.decode() if roots else None)
    chain, key = getattr(security, "certificate_chain", None), getattr(security, "private_key", None)
    if chain is not None and key is not None:  # ssl loads certificates from files only: a private temporary one
        with tempfile.TemporaryDirectory() as tmp:
            cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            for path, data in ((cert_path, chain), (key_path, key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            context.load_cert_chain(cert_path, key_path)
    return context


class StreamConnection:
    """One bulk connection of a session, with the worker thread that drives it (READs in order)."""

    def __init__(self, host: str, port: int, session_id: str, credential: bytes,
                 ssl_context: ssl.SSLContext | None = None, read_timeout_s: float = READ_TIMEOUT_S):
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=host)
            sock.sendall(frames.hello(session_id, credential))
            status, _, message = frames.read_answer(sock)
            if status != frames.OK:
                raise StreamPlaneError(message or f"stream connection refused ({frames.STATUS_NAMES.get(status)})")
            if ssl_context is None:
                sock.settimeout(None)  # blocking recv_into; the kernel bounds a wait
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(read_timeout_s))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(read_timeout_s))
            else:
                sock.settimeout(read_timeout_s)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="gear-stream-recv")
        self.broken: BaseException | None = None

    def read(self, lease_id: int, version: int, windows: np.ndarray, buf: np.ndarray) -> bool:
        """Ask for ``windows`` (``[n, 4]``: slot, remote, local, length) and receive them into ``buf``.

        False when the daemon says the lease is gone (nothing was sent; the batch comes back stale).
        """
        if self.broken is not None:
            raise StreamConnectionLost(f"stream connection broken earlier: {self.broken}")
        try:
            view = memoryview(buf)
            for start in range(0, len(windows), frames.MAX_WINDOWS):
                part = windows[start:start + frames.MAX_WINDOWS]
                self.sock.sendall(frames.read_request(lease_id, version, part[:, (0, 1, 3)]))
                status, size, message = frames.read_answer(self.sock)
                if status == frames.LEASE_GONE:
                    return False
                if status == frames.LAYOUT_GONE:
                    raise StreamLayoutGone(f"the daemon no longer serves layout version {version}: {message}")
                if status != frames.OK:
                    raise StreamPlaneError(f"the daemon refused a READ ({frames.STATUS_NAMES.get(status)}): {message}")
                if size != int(part[:, 3].sum()):
                    raise frames.StreamProtocolError(f"the daemon announced {size} bytes for "
                                                     f"{int(part[:, 3].sum())} asked")
                # the windows' bytes arrive back to back in the order asked: scattered into their places
                frames.recv_scatter(self.sock, [view[local:local + length] for local, length in _spans(part[:, 2],
                                                                                                      part[:, 3])])
            return True
        except StreamPlaneError:
            raise
        except (OSError, frames.StreamProtocolError, ssl.SSLError) as exc:
            self.broken = exc
            raise StreamConnectionLost(f"stream connection to the daemon lost: {exc}") from exc

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.worker.shutdown(wait=True)
        self.sock.close()


def _spans(local: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive windows adjacent in the buffer merged into (offset, length) spans, order kept."""
    if not len(local):
        return []
    heads = np.concatenate(([True], local[1:] != local[:-1] + length[:-1]))
    group = np.cumsum(heads) - 1
    sizes = np.bincount(group, weights=length, minlength=int(heads.sum())).astype(np.int64)
    return list(zip(local[heads].tolist(), sizes.tolist(), strict=True))


def split_parts(windows: np.ndarray, parts: int) -> list[np.ndarray]:
    """Cut windows (in the order asked) into at most ``parts`` contiguous runs of about equal bytes."""
    if parts <= 1 or len(windows) <= 1:
        return [windows]
    cum = np.cumsum(windows[:, 3])
    total = int(cum[-1])
    cuts = np.searchsorted(cum, [total * k // parts for k in range(1, parts)], side="left") + 1
    pieces = np.split(windows, np.unique(np.clip(cuts, 1, len(windows))))
    return [p for p in pieces if len(p)]


def stream_windows(layout: TableLayout, selection: ItemSelection, starts: np.ndarray, counts: np.ndarray,
                   batch: BatchLayout, firsts: np.ndarray) -> np.ndarray:
    """``int64 [n, 4]`` (slot, segment offset, buffer offset, length) of a selection, in file order.

    In file order an item's columns (one row of the segment) are adjacent, and so are
    consecutive slots: the daemon sends each run with one ``sendfile``, the learner
    scatters it into the batch's columns with one ``recvmsg_into``.
    """
    slots = np.asarray(selection.slots, dtype=np.int64)
    ranges = plan_ranges(layout, slots, starts, counts, batch, firsts)
    step_bytes = np.array([c.step_bytes for c in layout.columns], dtype=np.int64)
    # plan_ranges lists column by column, item by item, and drops the empty ones
    kept = (np.asarray(counts, dtype=np.int64) * step_bytes).T.reshape(-1) > 0
    out = np.empty((len(ranges), 4), dtype=np.int64)
    out[:, 0] = np.tile(slots, len(layout.columns))[kept]
    out[:, 1] = ranges[:, REMOTE]
    out[:, 2] = ranges[:, LOCAL]
    out[:, 3] = ranges[:, LENGTH]
    return out[np.argsort(out[:, 1], kind="stable")]


class StreamPlane:
    """Batches received over the session's TCP connections (see module docstring)."""

    kind = "stream"

    def __init__(self, session: PlaneSession, layout: TableLayout | None, endpoint: pb.StreamEndpoint, host: str, *,
                 security: Any = None, device: Any = None, connections: int | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S, columns: ColumnChoice | None = None):
        self.session = session
        self.layout = layout
        self.device = device
        self.columns = columns  # read only these columns' windows (None: all)
        self.bytes_moved = 0  # bytes received from the daemon's segment
        wanted = endpoint.connections if connections is None else min(connections, endpoint.connections)
        host = endpoint.host or host
        context = client_ssl_context(security, host) if endpoint.tls else None
        self.connections: list[StreamConnection] = []
        try:
            for _ in range(max(1, wanted)):
                self.connections.append(StreamConnection(host, endpoint.port, session.session_id,
                                                         endpoint.credential, context, read_timeout_s))
        except BaseException:
            self.close()
            raise
        allocate = _pinned_empty if is_gpu_device(device) else None
        self._pool = BufferPool(allocate=allocate)
        self.lease_gone = 0  # READs the daemon answered "lease gone" (their batches come back stale)

    def set_layout(self, layout: TableLayout, region=None) -> None:
        """Windows address ``layout``'s segment from now on (the daemon opened its file for this session)."""
        self.layout = layout

    def pipelined(self) -> None:
        """Nothing changes: every batch is received by the connections' worker threads."""

    def cancel(self) -> None:
        """Nothing to end here: a READ in flight completes or times out (closing shuts the connections)."""

    def fetch(self, selection: ItemSelection, window: WindowSpec) -> SampledBatch:
        return self.start(selection, window).wait()

    def start(self, selection: ItemSelection, window: WindowSpec) -> Pending:
        """Send each connection its part of the batch; the workers receive while the caller goes on."""
        layout, lengths = narrowed(self.columns, self.layout, selection.lengths)
        n = len(selection)
        windows = resolve_windows(layout, window)
        batch = BatchLayout.build(layout, n, window_steps(windows))
        starts, counts, firsts = window_bounds(lengths, layout, windows)
        planned = stream_windows(layout, selection, starts, counts, batch, firsts)
        buf = self._pool.get(batch.nbytes)
        total = int(planned[:, 3].sum()) if len(planned) else 0
        self.bytes_moved += total
        parts = split_parts(planned, min(len(self.connections), max(1, -(-total // MIN_PART_BYTES))))
        lease, version = selection.lease_id, selection.layout_version
        futures = [conn.worker.submit(conn.read, lease, version, part, buf)
                   for conn, part in zip(self.connections, parts, strict=False)]

        def finish() -> SampledBatch:
            wait(futures)  # every part done (or failed) before the lease may go
            intact = [f.result() for f in futures]
            if not all(intact):
                self.lease_gone += 1
            for off, length in padding_ranges(counts, batch, firsts).tolist():
                buf[off:off + length] = 0
            keys, probs, sizes, prios, times = selection.infos
            return SampledBatch(keys, probs, sizes, prios, times, column_arrays(buf, layout, batch, n),
                                counts.astype(np.int32), layout.structure, tuple(c.squeeze for c in layout.columns),
                                plane=self.kind)

        return Pending(finish)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.connections = []
        self._pool.clear()


def _pinned_empty(nbytes: int) -> np.ndarray:
    """A page-locked host buffer (CUDA), so the batch's copy to the GPU runs at the PCIe rate."""
    import cupy as cp

    memory = cp.cuda.alloc_pinned_memory(max(nbytes, 1))
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes)
