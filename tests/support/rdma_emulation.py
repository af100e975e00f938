"""An emulated RDMA NIC for one process: the daemon's RdmaServer and the learner's VerbsConnection.

The daemon and the learner of these tests share a process, so "remote memory"
is a registry of mapped segments keyed by (address, rkey); the emulated NIC
copies from there and reports completions the way an RC queue pair does
(in order per queue pair, only signalled requests complete).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from gear_client.data_planes.rdma import DEFAULT_MAX_SEND_WR
from gear_contract import addressing
from gear_contract._proto import replay_pb2 as pb
from gear_contract.rdma_verbs import Completion, Region

REGISTERED: dict[tuple[int, int], np.ndarray] = {}
REG_LOCK = threading.Lock()
_rkeys = itertools.count(0x1000)


def emulated_port(name: str = "emu0", link_layer: str = addressing.LINK_ETHERNET) -> addressing.PortInfo:
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    return addressing.PortInfo(device=name, port=1, link_layer=link_layer, lid=0 if link_layer != "IB" else 7,
                               gid=gid, gid_index=3, active_mtu=5, max_msg_size=1 << 30, max_qp_rd_atom=16)


@dataclass
class EmulatedResources:
    qp_nums: list[int]
    segment: str | None = None
    region: pb.RdmaRegion | None = None
    mapping: mmap.mmap | None = None
    closed: bool = False


class EmulatedRdmaServer:
    """The daemon side (the RdmaServer interface) over the emulated NIC; counts what it did."""

    def __init__(self):
        self.port = emulated_port()
        self.accepted: list[EmulatedResources] = []
        self.closed_sessions = 0
        self._qpn = itertools.count(0x100)

    def accept(self, learner: pb.RdmaEndpoint):
        addressing.validate_endpoint(learner)
        addressing.address_vector(self.port, learner)
        res = EmulatedResources([next(self._qpn) for _ in learner.qp_nums])
        self.accepted.append(res)
        return res, self.port.endpoint(res.qp_nums, [1] * len(res.qp_nums))

    def attach(self, res: EmulatedResources, layout) -> pb.RdmaRegion:
        fd = os.open(layout.segment, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, layout.segment_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = np.frombuffer(mapping, dtype=np.uint8)
        rkey = next(_rkeys)
        addr = int(view.ctypes.data)
        with REG_LOCK:
            REGISTERED[(addr, rkey)] = view
        res.segment, res.mapping = layout.segment, mapping
        res.region = pb.RdmaRegion(addr=addr, rkey=rkey, length=layout.segment_size)
        return res.region

    def close_session(self, res: EmulatedResources) -> None:
        res.closed = True
        self.closed_sessions += 1
        if res.region is not None:
            with REG_LOCK:
                REGISTERED.pop((res.region.addr, res.region.rkey), None)

    def close(self) -> None:
        pass


class EmulatedConnection:
    """The learner side: what RdmaPlane needs of a VerbsConnection, over the emulated NIC.

    ``fail_after`` makes the n-th posted chain complete with an error status (12:
    IBV_WC_RETRY_EXC_ERR); ``max_outstanding`` asserts the scheduler never has
    more chains in flight on a queue pair.
    """

    def __init__(self, num_qps: int = 4, *, max_send_wr: int = DEFAULT_MAX_SEND_WR, max_message: int = 1 << 30,
                 fail_after: int | None = None, reorder: bool = True):
        self.port = emulated_port()
        self.num_qps = num_qps
        self.max_send_wr = max_send_wr
        self.max_message = max_message
        self.fail_after = fail_after
        self.reorder = reorder
        self.posted_chains = 0
        self.posted_requests = 0
        self.signalled = 0
        self.connected_to: pb.RdmaEndpoint | None = None
        self.closed = False
        self.max_in_flight_seen = 0
        self._qps = list(range(0x500, 0x500 + num_qps))
        self._in_flight: list[list[Completion]] = [[] for _ in range(num_qps)]
        self._buffers: dict[int, tuple[np.ndarray, Region]] = {}
        self._rng = np.random.default_rng(0)

    def endpoint(self) -> pb.RdmaEndpoint:
        return self.port.endpoint(self._qps, [7] * self.num_qps)

    def connect(self, remote: pb.RdmaEndpoint) -> None:
        addressing.validate_endpoint(remote, expected_qps=self.num_qps)
        self.connected_to = remote

    def allocate(self, nbytes: int) -> np.ndarray:
        buf = np.zeros(max(nbytes, 4096), dtype=np.uint8)
        addr = int(buf.ctypes.data)
        self._buffers[addr] = (buf, Region(addr, buf.nbytes, lkey=addr & 0xFFFF, rkey=0))
        return buf

    def region_of(self, buf: np.ndarray) -> Region:
        return self._buffers[int(buf.ctypes.data)][1]

    def free(self, buf: np.ndarray) -> None:
        del self._buffers[int(buf.ctypes.data)]

    def post_reads(self, queue: int, wr_id: int, ranges: np.ndarray, local: Region, remote: pb.RdmaRegion) -> None:
        self.posted_chains += 1
        self.posted_requests += len(ranges)
        with REG_LOCK:
            source = REGISTERED.get((remote.addr, remote.rkey))
        dest = self._buffers[local.addr][0]
        ok = source is not None and (self.fail_after is None or self.posted_chains <= self.fail_after)
        if ok:
            for r_off, l_off, length in ranges.tolist():
                if length > self.max_message or r_off + length > remote.length or l_off + length > local.length:
                    ok = False
                    break
                dest[l_off:l_off + length] = source[r_off:r_off + length]
        self._in_flight[queue].append(Completion(wr_id, ok, 0 if ok else 12, queue))
        self.max_in_flight_seen = max(self.max_in_flight_seen, len(self._in_flight[queue]))

    def poll(self, max_entries: int = 32) -> list[Completion]:
        queues = [q for q in range(self.num_qps) if self._in_flight[q]]
        if self.reorder:
            self._rng.shuffle(queues)
        out = []
        for q in queues:
            while self._in_flight[q] and len(out) < max_entries:
                out.append(self._in_flight[q].pop(0))  # in order within a queue pair
        self.signalled += len(out)
        return out

    def close(self) -> None:
        self.closed = True
