"""How a writer's items reach the daemon: the insert plane on its host, an ingest worker elsewhere.

* On the daemon's host (same host identity as ``ServerInfo.host_id``) a writer
  opens a ``SlotWriter`` (gear_contract.slot_writer) and copies each item that
  fits the table's layout straight into a reserved slot of the shared-memory
  segment; only the commit (key, priority, slot, lengths) crosses the socket.
* On another host, when the daemon serves the stream plane, the same
  ``SlotWriter`` reserves and commits over gRPC and sends each item's rows on a
  TCP connection of the stream plane (gear_contract.stream_rows); the daemon
  receives them straight into the reserved slot.
* Otherwise, when the daemon runs ingest workers (``ServerInfo.ingest_ports``),
  the writer's InsertStream goes to one of them (the first of the list, which
  the daemon starts one further at each ServerInfo, so writers spread evenly
  over the workers), on the host the client dialled, with the client's
  security (token, TLS).
* Else the InsertStream goes to the daemon itself.

The ``SlotWriter`` (insert plane or stream plane) is opened only once it pays
for its stream (an open and a reservation round trip, and a stream the daemon
serves): at the writer's
first item of ``PLANE_MIN_ITEM_BYTES`` or more (the bytes it keeps off the
daemon's socket pay for it at once), or after the writer's first flush (an
actor that goes on writing). A writer of a few small items (an actor in a
connect storm) keeps to its one InsertStream.

``GEAR_INSERT_PLANE=0`` keeps every
insert on InsertStream; ``GEAR_INSERT_STREAM=0`` keeps a writer on another host off
the stream plane; ``GEAR_INGEST_WORKERS=0`` keeps InsertStream on the daemon's port.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import grpc
import numpy as np

from gear_client.connection.auth import ChannelSecurity
from gear_client.connection.channel import DEFAULT_CONNECT_TIMEOUT_S
from gear_client.data_planes.stream import client_ssl_context
from gear_client.errors import ReverbError
from gear_client.writers.trajectory_column import TrajectoryColumn
from gear_contract._proto import replay_pb2 as pb
from gear_contract.negotiation import local_host_id
from gear_contract.slot_writer import InsertPlaneUnavailable, OpenTimedOut, SegmentGone, SlotWriter, UncommittedItem

log = logging.getLogger(__name__)

ENV_INSERT_PLANE = "GEAR_INSERT_PLANE"
ENV_INGEST_WORKERS = "GEAR_INGEST_WORKERS"
# A ServerInfo answer this recent (the one ``trajectory_writer`` asked for) serves the routes' choice.
SERVER_INFO_MAX_AGE_S = 2.0
ENV_INSERT_STREAM = "GEAR_INSERT_STREAM"
# An item of at least this many bytes opens the insert plane at once (smaller ones: after the first flush).
PLANE_MIN_ITEM_BYTES = 16 << 10


def _enabled(env: str) -> bool:
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "no", "off")


@runtime_checkable
class DaemonClient(Protocol):
    """What the routes need of a ``gear_client.Client`` (test doubles without it keep InsertStream)."""

    server_address: str
    _security_args: dict[str, Any]

    def _fetch_server_info(self, timeout: float | None) -> pb.ServerInfoResponse: ...

    def _recent_server_info(self, max_age_s: float, timeout: float | None) -> pb.ServerInfoResponse: ...

    def _connect(self) -> tuple[grpc.Channel, Any, Any]: ...


_CLIENT_TYPES: dict[type, bool] = {}  # a runtime Protocol check looks at every member: once per class


def _is_client(client: Any) -> bool:
    kind = type(client)
    known = _CLIENT_TYPES.get(kind)
    if known is None:
        known = _CLIENT_TYPES[kind] = isinstance(client, DaemonClient)
    return known


def open_slot_writer(client: Any, timeout: float | None = None) -> SlotWriter | None:
    """A SlotWriter for this client's daemon when it runs on this host and allows it; None when the plane
    does not apply (another host, turned off, no access to the segments). Raises (ReverbError, RpcError)
    when the daemon does not answer within ``timeout`` (None: the client's connect timeout). The writer's
    waits on the daemon are bounded by the client's connect timeout (DaemonNotAnswering past it)."""
    if not _enabled(ENV_INSERT_PLANE) or not _is_client(client):
        return None
    info = client._recent_server_info(SERVER_INFO_MAX_AGE_S, timeout)
    stream_host = None
    if not info.host_id or info.host_id != local_host_id():  # another host: rows over a stream connection
        parts = split_target(client.server_address)
        if not _enabled(ENV_INSERT_STREAM) or parts is None:
            return None
        stream_host = parts[0].strip("[]")
    channel, _, _ = client._connect()
    connect_timeout = getattr(client, "_connect_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    security = ChannelSecurity.build(**client._security_args) if stream_host is not None else None
    try:
        return SlotWriter(channel, open_timeout=connect_timeout if timeout is None else timeout,
                          answer_timeout=connect_timeout, address=client.server_address, stream_host=stream_host,
                          stream_ssl=(lambda host: stream_ssl_context(security)) if security is not None else None)
    except (SegmentGone, OpenTimedOut):
        raise
    except InsertPlaneUnavailable as e:
        log.info("insert plane unavailable, inserting over InsertStream: %s", e)
        return None


def split_target(address: str) -> tuple[str, str] | None:
    """(host, port) of a ``host:port`` / ``[v6]:port`` target; None for other forms (unix:, dns:///...)."""
    if "://" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host, port


def stream_ssl_context(security: ChannelSecurity) -> Any:
    """TLS for a remote writer's row connection, from the client's control-plane settings."""
    return client_ssl_context(security, "")


def ingest_target(client: Any) -> str | None:
    """The ``host:port`` of the ingest worker this writer should stream to; None: stream to the daemon's own
    port (no workers, or an address of another form)."""
    if not _enabled(ENV_INGEST_WORKERS) or not _is_client(client):
        return None
    try:
        ports = list(client._recent_server_info(SERVER_INFO_MAX_AGE_S, None).ingest_ports)
    except ReverbError:
        return None
    parts = split_target(client.server_address)
    if not ports or parts is None:
        return None
    return f"{parts[0]}:{ports[0]}"  # the daemon lists them starting one further each time


def _item_bytes(flat: Sequence[TrajectoryColumn]) -> int:
    """The bytes of an item's rows."""
    total = 0
    for column in flat:
        first = column.segments[0][0]
        total += len(column) * first.dtype.itemsize * math.prod(first.shape)
    return total


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs [start, stop) of a row sequence."""
    if isinstance(rows, range) and rows.step == 1:
        return [(rows.start, rows.stop)]
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def item_rows(flat: Sequence[TrajectoryColumn]) -> tuple[list[tuple[np.dtype, tuple, bool]], list[int],
                                                         list[list[np.ndarray]], list[int]]:
    """An item's columns as the insert plane writes them: per column (dtype, step shape, squeeze), length,
    row pieces (views of the writer's column buffers), and the episodes its rows belong to."""
    specs, lengths, pieces, episodes = [], [], [], set()
    for column in flat:
        first = column.segments[0][0]
        specs.append((first.dtype, tuple(first.shape), column.is_squeezed))
        lengths.append(len(column))
        parts = []
        for col, rows in column.segments:
            for start, stop in _runs(rows):
                parts.append(col.rows_array(start, stop))
                pos = start
                while pos < stop:
                    episode, pos = col.episode_of(pos)
                    episodes.add(episode)
        pieces.append(parts)
    return specs, lengths, pieces, sorted(episodes)


class ItemRows(NamedTuple):
    specs: list[tuple[np.dtype, tuple, bool]]
    lengths: list[int]
    pieces: list[list[np.ndarray]]
    episodes: list[int]


class SameHostRoute:
    """A writer's insert-plane path (opened once it pays, see the module docstring; ``prepare`` says whether
    it takes an item).

    When the plane's stream fails for a transient reason (the daemon went away), ``take_uncommitted``
    hands the items it had not committed to the writer's InsertStream, which reconnects and resends;
    the plane is tried again ``RETRY_S`` later.
    """

    RETRY_S = 5.0

    def __init__(self, client: Any):
        self._client = client
        self._writer: SlotWriter | None = None
        self._disabled = False  # not applicable (another host, no access): InsertStream for good
        self._retry_at = 0.0
        self._opened_once = False
        self._wanted = False  # the plane pays: a big item or a flush came

    def flushed(self) -> None:
        """The writer flushed: a writer that goes on writing opens the plane from its next item."""
        self._wanted = True

    @property
    def writer(self) -> SlotWriter | None:
        if (self._writer is None and self._wanted and not self._disabled
                and time.monotonic() >= self._retry_at):
            try:
                writer = open_slot_writer(self._client, timeout=None if not self._opened_once else 1.0)
            except (ReverbError, grpc.RpcError, InsertPlaneUnavailable) as e:
                log.info("insert plane not open (%s): InsertStream for %.0f s", e, self.RETRY_S)
                self._retry_at = time.monotonic() + self.RETRY_S
                return None
            self._disabled = writer is None
            self._opened_once = True
            self._writer = writer
        return self._writer

    @property
    def in_flight(self) -> int:
        return self._writer.in_flight if self._writer is not None else 0

    def take_uncommitted(self, error: BaseException) -> list[UncommittedItem]:
        """Close a failed plane and return its uncommitted items (to be sent over InsertStream). The plane
        is tried again later, unless it cannot work here (a segment this process cannot open)."""
        writer, self._writer = self._writer, None
        self._retry_at = time.monotonic() + self.RETRY_S
        if isinstance(error, InsertPlaneUnavailable) and not isinstance(error, SegmentGone):
            log.info("insert plane unavailable, inserting over InsertStream: %s", error)
            self._disabled = True
        if writer is None:
            return []
        items = writer.uncommitted()
        writer.abort()
        return items

    def prepare(self, table: str, structure: bytes, flat: Sequence[TrajectoryColumn]) -> ItemRows | None:
        """The item's rows when it fits the table's layout on this path (None: send it over InsertStream)."""
        if not self._wanted and _item_bytes(flat) >= PLANE_MIN_ITEM_BYTES:
            self._wanted = True
        writer = self.writer
        if writer is None:
            return None
        rows = ItemRows(*item_rows(flat))
        return rows if writer.fits(table, rows.specs, rows.lengths, structure) else None

    def write(self, table: str, key: int, priority: float, rows: ItemRows, max_in_flight: int,
              max_in_flight_bytes: int) -> None:
        """Copy a prepared item into a reserved slot and queue its commit (blocks past the in-flight bounds)."""
        self._writer.wait(max_in_flight - 1, max_in_flight_bytes)
        self._writer.write(table, key, priority, rows.pieces, rows.lengths, rows.episodes)

    def wait(self, max_items: int, deadline: float | None = None) -> bool:
        return self._writer.wait(max_items, deadline=deadline) if self._writer is not None else True

    @property
    def error(self) -> BaseException | None:
        return self._writer.error if self._writer is not None else None

    def close(self, wait: bool = True) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            if wait:
                writer.close()
            else:
                writer.abort()
