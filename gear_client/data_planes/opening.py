"""Opening one table's data plane: offer the planes allowed, build the one the daemon picks, fall back.

The learner offers device (when its batches go to a GPU), shm, rdma, nixl (where NIXL is
installed), stream (when it knows the daemon's host) and inline as allowed and available
(rdma with the endpoint of a connection made for it); the daemon answers with one. A plane
that cannot come up here (segment not openable, RDMA connection refused) is
excluded and the next best negotiated, until one comes up or none is left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gear_client import errors
from gear_client.connection.channel import DaemonChannel
from gear_client.data_planes.plane import ReadingPlane, SamplingPlane
from gear_client.data_planes.projection import ColumnChoice
from gear_client.data_planes.session import PlaneSession
from gear_contract import negotiation, nixl_agents
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

log = logging.getLogger(__name__)


@dataclass
class OpenedPlane:
    """A plane that came up: a reading plane (shm, rdma) with its session, or the inline plane."""

    reader: ReadingPlane | None
    inline: SamplingPlane | None
    session: PlaneSession | None
    layout: TableLayout | None  # None while the table is empty: the first Select brings it


@dataclass
class PlaneOpener:
    """Negotiates planes for one table (``open``); holds what every negotiation needs."""

    stub: Any
    table: str
    planes: tuple[str, ...]
    host_id: str
    device: Any = None
    rdma_device: str | None = None
    num_qps: int | None = None
    metadata: Any = None
    daemon: DaemonChannel | None = None
    sample_call: Any = None
    # () -> a connected-to-be RDMA transport or None; None: the verbs device found by probing
    rdma_connection: Callable[[], Any] | None = None
    group: pb.SelectionGroup | None = None  # a rank of a selection group (groups need shm or rdma)
    columns: ColumnChoice | None = None  # read only these columns
    stream_connections: int | None = None  # at most this many bulk connections (None: as the daemon allows)

    def _allowed(self, excluded: set[str]) -> list[str]:
        allowed = [p for p in self.planes if p not in excluded]
        if not allowed:
            raise RuntimeError(f"no data plane left to try for table '{self.table}' (allowed: {list(self.planes)})")
        return allowed

    def _rdma_connection(self, allowed: list[str]):
        if negotiation.RDMA not in allowed:
            return None
        return (self.rdma_connection or self._verbs_connection)()

    def _verbs_connection(self):
        from gear_contract import rdma_verbs as verbs

        port = verbs.probe(self.rdma_device)
        if port is None:
            return None
        from gear_client.data_planes.rdma import DEFAULT_NUM_QPS, VerbsConnection

        try:
            return VerbsConnection(port, num_qps=self.num_qps or DEFAULT_NUM_QPS)
        except Exception as exc:  # noqa: BLE001 - a device that cannot give us queue pairs: no rdma
            log.warning("RDMA device %s unusable, not offering rdma: %s", port.device, exc)
            return None

    def open(self, excluded: set[str]) -> OpenedPlane:
        """Negotiate a plane; falls back plane by plane (adding each that fails to ``excluded``) until one comes up."""
        while True:
            allowed = self._allowed(excluded)
            if self._stream_host() is None:  # no host to reach the daemon's listener on (a bare channel or stub)
                allowed = [p for p in allowed if p != negotiation.STREAM] or allowed
            if negotiation.NIXL in allowed and nixl_agents.unavailable_reason() is not None:
                allowed = [p for p in allowed if p != negotiation.NIXL] or allowed
            conn = self._rdma_connection(allowed)
            offer = negotiation.build_offer(allowed, self.host_id, conn.endpoint() if conn is not None else None,
                                            device=self._reads_gpu_mirrors())
            try:
                if self.daemon is not None:
                    self.daemon.wait_ready("sample")
                request = pb.OpenDataPlaneRequest(table=self.table, offer=offer)
                if self.group is not None:
                    request.group.CopyFrom(self.group)
                response = self.stub.OpenDataPlane(request, metadata=self.metadata,
                                                   wait_for_ready=self.daemon is None)
            except (grpc.RpcError, errors.ReverbError) as exc:
                if conn is not None:
                    conn.close()
                if not isinstance(exc, grpc.RpcError):
                    raise
                connect_error = self.daemon.error_for(exc, "sample") if self.daemon is not None else None
                raise (connect_error or errors.from_rpc_error(exc, "sample")) from exc
            if response.kind != negotiation.RDMA and conn is not None:
                conn.close()
                conn = None
            layout = TableLayout.from_proto(response.layout) if response.HasField("layout") else None
            if self.columns is not None and layout is not None:
                try:
                    self.columns.indices(layout)  # an unknown path is refused before anything is selected
                except ValueError:
                    if conn is not None:
                        conn.close()
                    if response.session_id:
                        PlaneSession(self.stub, self.table, response, metadata=self.metadata).close()
                    raise
            if response.kind == negotiation.INLINE:
                from gear_client.data_planes.inline import InlinePlane

                inline = InlinePlane(self.stub, self.table, layout, sample_call=self.sample_call,
                                     metadata=self.metadata, columns=self.columns)
                return OpenedPlane(None, inline, None, layout)
            session = PlaneSession(self.stub, self.table, response, metadata=self.metadata, daemon=self.daemon)
            try:  # an empty table has no layout yet: the first Select brings it
                reader = self._build(response, session, layout, conn)
            except Exception as exc:  # noqa: BLE001 - the plane cannot come up here: next best
                log.info("%s plane for table '%s' unusable (%s); falling back", response.kind, self.table, exc)
                session.close()
                if conn is not None:
                    conn.close()
                excluded.add(response.kind)
                continue
            return OpenedPlane(reader, None, session, layout)

    def _reads_gpu_mirrors(self) -> bool:
        """Whether to offer the device plane: batches go to a GPU here (and this is no rank of a group)."""
        from gear_client.data_planes.shm import is_gpu_device

        if self.group is not None or not is_gpu_device(self.device):
            return False
        from gear_kernels import gpu_available

        return gpu_available()

    def _build(self, response: pb.OpenDataPlaneResponse, session: PlaneSession, layout: TableLayout | None,
               conn) -> ReadingPlane:
        if response.kind == negotiation.DEVICE:
            from gear_client.data_planes.device import DevicePlane

            return DevicePlane(session, layout, response.device_tier, device=self.device, columns=self.columns)
        if response.kind == negotiation.SHM:
            from gear_client.data_planes.shm import ShmPlane

            return ShmPlane(session, layout, device=self.device, columns=self.columns)
        if response.kind == negotiation.RDMA:
            from gear_client.data_planes.rdma import RdmaPlane

            if conn is None or not response.HasField("rdma"):
                raise RuntimeError("the daemon chose rdma without an endpoint")
            conn.connect(response.rdma)
            return RdmaPlane(session, layout, response.region if response.HasField("region") else None, conn,
                             columns=self.columns)
        if response.kind == negotiation.NIXL:
            from gear_client.data_planes.nixl import NixlPlane

            if not response.HasField("nixl") and layout is not None:
                raise RuntimeError("the daemon chose nixl without its agent's region")
            return NixlPlane(session, layout, response.nixl if response.HasField("nixl") else None,
                             device=self.device, columns=self.columns)
        if response.kind == negotiation.STREAM:
            from gear_client.data_planes.stream import StreamPlane

            if not response.HasField("stream"):
                raise RuntimeError("the daemon chose stream without its endpoint")
            host = self._stream_host()
            if host is None and not response.stream.host:
                raise RuntimeError("the daemon chose stream but its host is not known here")
            return StreamPlane(session, layout, response.stream, host or "", device=self.device,
                               security=getattr(self.daemon, "security", None), connections=self.stream_connections,
                               columns=self.columns)
        raise RuntimeError(f"the daemon chose an unknown plane {response.kind!r}")

    def _stream_host(self) -> str | None:
        """The host this learner reached the control plane on (the stream listener's, unless advertised)."""
        if self.daemon is None:
            return None
        return stream_host(self.daemon.address)


def stream_host(address: str) -> str | None:
    """The host part of a ``host:port`` control-plane address (brackets of IPv6 removed); None for other forms."""
    if "://" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]")
