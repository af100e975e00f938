"""The daemon's side of the RDMA plane: segments registered for remote reads, learners' queue pairs.

The daemon is the passive side of one-sided RDMA READs: it maps each table
segment, registers it once with the NIC (remote-read access, shared by every
session that reads that segment version) and, per learner session, creates as
many RC queue pairs as the learner offered and connects them to the learner's.
The learner then reads the selected ranges itself; no daemon CPU touches them.
All verbs calls go through ``gear_contract.rdma_verbs``.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass

from gear_contract import addressing
from gear_contract import rdma_verbs as verbs
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_server.data_planes.settings import DataPlaneSettings

log = logging.getLogger(__name__)

MAX_QPS_PER_SESSION = 16


@dataclass
class _Registered:
    mapping: mmap.mmap
    region: verbs.Region
    address: int
    sessions: int = 0


@dataclass
class RdmaSessionResources:
    """What one learner session holds: its queue pairs and a reference on the registered segment it reads."""

    queue_pairs: verbs.QueuePairs
    segment: str | None = None
    region: pb.RdmaRegion | None = None


class RdmaServer:
    """Owns the daemon's opened RDMA device and the segments registered on it (thread safe)."""

    def __init__(self, port: addressing.PortInfo, *, max_qps_per_session: int = MAX_QPS_PER_SESSION):
        self.port = port
        self.max_qps_per_session = max_qps_per_session
        self.device = verbs.Device(port, responder=True)
        self._lock = threading.Lock()
        self._segments: dict[str, _Registered] = {}

    @classmethod
    def probe(cls, device: str | None = None) -> RdmaServer | None:
        """An RdmaServer on the first active port (of ``device``), or None without pyverbs or a device."""
        return cls.open(DataPlaneSettings(rdma_device=device))[0]

    @classmethod
    def open(cls, settings: DataPlaneSettings) -> tuple[RdmaServer | None, str | None]:
        """(an RdmaServer on the configured or first active port, None) or (None, why RDMA is off)."""
        if not settings.rdma:
            return None, "turned off ([data_planes] rdma = false)"
        reason = verbs.unavailable_reason()
        if reason is not None:
            return None, reason
        try:
            info = verbs.probe(settings.rdma_device, settings.rdma_port, settings.rdma_gid_index,
                               settings.rdma_service_level, settings.rdma_traffic_class)
        except ValueError as exc:  # a GEAR_RDMA_* variable out of range
            return None, f"bad RDMA setting: {exc}"
        if info is None:
            devices = verbs.device_names()
            if not devices:
                return None, "no RDMA device"
            wanted = settings.rdma_device or ", ".join(devices)
            return None, f"no active port on {wanted}"
        try:
            return cls(info), None
        except (verbs.VerbsError, verbs.VerbsUnavailableError) as exc:
            return None, f"RDMA device {info.device} found but unusable: {exc}"

    def _acquire_segment(self, layout: TableLayout) -> _Registered:
        with self._lock:
            reg = self._segments.get(layout.segment)
            if reg is None:
                mapping, address = map_segment(layout)
                try:
                    region = self.device.register(address, layout.segment_size)
                except BaseException:
                    mapping.close()
                    raise
                reg = _Registered(mapping, region, address)
                self._segments[layout.segment] = reg
            reg.sessions += 1
            return reg

    def _release_segment(self, segment: str) -> None:
        with self._lock:
            reg = self._segments.get(segment)
            if reg is None:
                return
            reg.sessions -= 1
            if reg.sessions > 0:
                return
            del self._segments[segment]
        self.device.deregister(reg.region)
        reg.mapping.close()

    def accept(self, learner: pb.RdmaEndpoint) -> tuple[RdmaSessionResources, pb.RdmaEndpoint]:
        """Create and connect queue pairs to a learner's endpoint; returns (resources, the daemon's endpoint).

        ValueError for an endpoint that cannot be served; verbs.VerbsError when the device refuses.
        """
        addressing.validate_endpoint(learner)
        if len(learner.qp_nums) > self.max_qps_per_session:
            raise ValueError(f"at most {self.max_qps_per_session} queue pairs per session, got {len(learner.qp_nums)}")
        av = addressing.address_vector(self.port, learner)
        qps = verbs.QueuePairs(self.device, len(learner.qp_nums), max_send_wr=1)
        try:
            qps.connect(learner, av, addressing.path_mtu(self.port, learner), addressing.rd_atomic(self.port, learner))
        except BaseException:
            qps.close()
            raise
        return RdmaSessionResources(qps), qps.endpoint()

    def attach(self, resources: RdmaSessionResources, layout: TableLayout) -> pb.RdmaRegion:
        """Let the session read ``layout``'s segment (registered once for all sessions); returns its region."""
        if resources.segment == layout.segment and resources.region is not None:
            return resources.region
        reg = self._acquire_segment(layout)
        previous = resources.segment
        resources.segment = layout.segment
        resources.region = pb.RdmaRegion(addr=reg.region.addr, rkey=reg.region.rkey, length=reg.region.length)
        if previous is not None:
            self._release_segment(previous)
        return resources.region

    def close_session(self, resources: RdmaSessionResources) -> None:
        resources.queue_pairs.close()
        if resources.segment is not None:
            self._release_segment(resources.segment)
            resources.segment = None

    def close(self) -> None:
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
        for reg in segments:
            self.device.deregister(reg.region)
            reg.mapping.close()
        self.device.close()


def map_segment(layout: TableLayout) -> tuple[mmap.mmap, int]:
    """A table segment mapped shared and read-write (a NIC registers with local write access too), and the
    mapping's address: what the rdma and nixl planes register with their devices."""
    fd = os.open(layout.segment, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, layout.segment_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapping, _address_of(mapping)


def _address_of(mapping: mmap.mmap) -> int:
    """The virtual address of a mapping (a read-only NumPy view exposes it)."""
    import numpy as np

    view = np.frombuffer(mapping, dtype=np.uint8, count=1)
    address = int(view.ctypes.data)
    del view
    return address
