"""The only module that calls pyverbs: devices, protection domain, memory regions, RC queue pairs.

Everything around it (range planning, addressing choices, negotiation, the read
scheduler, fallback) is plain Python tested without hardware; this module keeps
each verbs call in one short method so what has not run on hardware is small and
easy to read. pyverbs is optional: without it, or without an RDMA device,
``probe()`` returns None and the learner does not offer the RDMA plane.

Install route (docs/DATA_PLANES.md): the distribution's ``python3-pyverbs``,
which matches the distribution's libibverbs, linked into the virtual environment.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.addressing import (
    GID_TYPE_IB,
    GID_TYPE_ROCE_V1,
    GID_TYPE_ROCE_V2,
    LINK_ETHERNET,
    LINK_IB,
    AddressVector,
    GidEntry,
    PortInfo,
    choose_gid_index,
    gid_to_bytes,
    gid_to_str,
)

try:  # pyverbs is an optional extra; importing it may also fail on a libibverbs ABI mismatch.
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
except (ImportError, OSError) as _exc:  # pragma: no cover - depends on the machine
    _IMPORT_ERROR: str | None = f"pyverbs not importable ({type(_exc).__name__}: {_exc})"
else:
    _IMPORT_ERROR = None

# Transport attributes (ibv_rc_pingpong's values): local ACK timeout 4.096us * 2^14 = 67 ms,
# 7 retries, RNR retries "infinite" (7), minimal RNR NAK timer 12 (0.64 ms).
ACK_TIMEOUT = 14
RETRY_COUNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12
MAX_GID_ENTRIES = 32  # GID table entries examined per port

# Environment overrides for the device, port and GID index to use.
ENV_DEVICE = "GEAR_RDMA_DEVICE"
ENV_PORT = "GEAR_RDMA_PORT"
ENV_GID_INDEX = "GEAR_RDMA_GID_INDEX"


class VerbsUnavailableError(RuntimeError):
    """pyverbs or an RDMA device is missing."""


class VerbsError(RuntimeError):
    """A verbs call failed (message names the call)."""


def unavailable_reason() -> str | None:
    """Why RDMA cannot be used here, or None when pyverbs imports."""
    return _IMPORT_ERROR


def device_names() -> list[str]:
    """Names of the RDMA devices on this host ([] without pyverbs or devices)."""
    if _IMPORT_ERROR is not None:
        return []
    try:
        return [dev.name.decode() for dev in get_device_list()]
    except PyverbsError:  # "Failed to get devices list": no RDMA subsystem at all
        return []


def _gid_type_name(ctx, port: int, index: int, link_layer: str) -> str:
    if link_layer != LINK_ETHERNET:
        return GID_TYPE_IB
    try:
        kind = ctx.query_gid_type(port, index)
    except PyverbsError:
        return GID_TYPE_ROCE_V1
    return GID_TYPE_ROCE_V2 if kind == e.IBV_GID_TYPE_SYSFS_ROCE_V2 else GID_TYPE_ROCE_V1


def _port_info(ctx, device: str, port: int, gid_index: int | None) -> PortInfo | None:
    attr = ctx.query_port(port)
    if attr.state != e.IBV_PORT_ACTIVE:
        return None
    link = LINK_ETHERNET if attr.link_layer == e.IBV_LINK_LAYER_ETHERNET else LINK_IB
    entries = []
    for index in range(min(attr.gid_tbl_len, MAX_GID_ENTRIES)):
        try:
            gid = gid_to_bytes(ctx.query_gid(port, index).gid)
        except PyverbsError:
            continue
        entries.append(GidEntry(index, gid, _gid_type_name(ctx, port, index, link)))
    chosen = gid_index if gid_index is not None else choose_gid_index(entries, link)
    gid = next((g.gid for g in entries if g.index == chosen), bytes(16))
    dev = ctx.query_device()
    return PortInfo(
        device=device, port=port, link_layer=link, lid=attr.lid, gid=gid, gid_index=chosen,
        active_mtu=attr.active_mtu, max_msg_size=attr.max_msg_sz, max_qp_rd_atom=dev.max_qp_rd_atom,
        max_qp_wr=dev.max_qp_wr, max_cqe=dev.max_cqe, gids=tuple(entries),
    )


def probe(device: str | None = None, port: int | None = None, gid_index: int | None = None) -> PortInfo | None:
    """The first active port (of ``device``, or of any device), or None.

    ``GEAR_RDMA_DEVICE``, ``GEAR_RDMA_PORT`` and ``GEAR_RDMA_GID_INDEX`` pin the
    choice when arguments are not given.
    """
    if _IMPORT_ERROR is not None:
        return None
    device = device or os.environ.get(ENV_DEVICE) or None
    port = port or (int(os.environ[ENV_PORT]) if os.environ.get(ENV_PORT) else None)
    if gid_index is None and os.environ.get(ENV_GID_INDEX):
        gid_index = int(os.environ[ENV_GID_INDEX])
    names = [device] if device else device_names()
    for name in names:
        try:
            ctx = Context(name=name)
        except PyverbsError:
            continue
        try:
            ports = [port] if port else range(1, ctx.query_device().phys_port_cnt + 1)
            for p in ports:
                info = _port_info(ctx, name, p, gid_index)
                if info is not None:
                    return info
        except PyverbsError:
            continue
        finally:
            ctx.close()
    return None


@dataclass(frozen=True)
class Region:
    """A registered memory region: what a work request names it by."""

    addr: int
    length: int
    lkey: int
    rkey: int

    def to_proto(self) -> pb.RdmaRegion:
        return pb.RdmaRegion(addr=self.addr, rkey=self.rkey, length=self.length)


@dataclass(frozen=True)
class Completion:
    wr_id: int
    ok: bool
    status: int
    queue: int  # local QP index, -1 if unknown


class Device:
    """An opened RDMA device port with one protection domain; registers memory regions."""

    def __init__(self, port: PortInfo, *, responder: bool = False):
        if _IMPORT_ERROR is not None:
            raise VerbsUnavailableError(_IMPORT_ERROR)
        self.port = port
        self.responder = responder
        self._mrs: dict[int, object] = {}
        self.ctx = self.pd = None
        try:
            self.ctx = Context(name=port.device)
            self.pd = PD(self.ctx)
        except PyverbsError as exc:
            self.close()
            raise VerbsError(f"opening {port.device}: {exc}") from exc

    @property
    def access(self) -> int:
        """Responder (daemon): peers may RDMA READ. Requester (learner): the NIC writes READ responses."""
        return e.IBV_ACCESS_REMOTE_READ if self.responder else e.IBV_ACCESS_LOCAL_WRITE

    def register(self, address: int, length: int) -> Region:
        """Register ``length`` bytes at ``address`` (ibv_reg_mr) with this side's access flags."""
        try:
            mr = MR(self.pd, length, self.access, address=address)
        except PyverbsError as exc:
            raise VerbsError(f"ibv_reg_mr({length} bytes at {address:#x}): {exc}") from exc
        self._mrs[mr.lkey] = mr
        return Region(int(address), int(length), mr.lkey, mr.rkey)

    def deregister(self, region: Region) -> None:
        mr = self._mrs.pop(region.lkey, None)
        if mr is not None:
            mr.close()

    def close(self) -> None:
        """Deregister every region, then free the PD and close the context."""
        for mr in self._mrs.values():
            _close_quietly(mr)
        self._mrs.clear()
        for name in ("pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                _close_quietly(obj)
                setattr(self, name, None)


class QueuePairs:
    """``num_qps`` RC queue pairs sharing one completion queue, on an opened Device."""

    def __init__(self, device: Device, num_qps: int, *, max_send_wr: int = 256, cq_depth: int | None = None):
        port = device.port
        self.device = device
        self._qps: list = []
        self.cq = None
        try:
            depth = cq_depth or max(16, min(port.max_cqe, num_qps * max_send_wr))
            self.cq = CQ(device.ctx, depth, None, None, 0)
            cap = QPCap(max_send_wr=max(1, min(max_send_wr, port.max_qp_wr)), max_recv_wr=1,
                        max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
            for _ in range(num_qps):
                self._qps.append(QP(device.pd, init, self._attr()))  # created in RESET, moved to INIT
        except PyverbsError as exc:
            self.close()
            raise VerbsError(f"creating {num_qps} RC queue pairs on {port.device}:{port.port}: {exc}") from exc
        self.psns = [random.getrandbits(24) for _ in self._qps]
        self._index = {qp.qp_num: i for i, qp in enumerate(self._qps)}

    def _attr(self) -> QPAttr:
        attr = QPAttr(port_num=self.device.port.port)
        attr.qp_access_flags = self.device.access
        attr.pkey_index = 0
        return attr

    @property
    def qp_nums(self) -> list[int]:
        return [qp.qp_num for qp in self._qps]

    def endpoint(self) -> pb.RdmaEndpoint:
        """This side's half of the exchange: port addressing plus queue-pair numbers and PSNs."""
        return self.device.port.endpoint(self.qp_nums, self.psns)

    def connect(self, remote: pb.RdmaEndpoint, av: AddressVector, mtu: int, rd_atomic: int) -> None:
        """INIT -> RTR -> RTS, queue pair i against the peer's queue pair i."""
        if len(remote.qp_nums) != len(self._qps):
            raise VerbsError(f"peer has {len(remote.qp_nums)} queue pairs, this side {len(self._qps)}")
        for i, qp in enumerate(self._qps):
            attr = rts_attr(self.device.port.port, self.device.access, remote.qp_nums[i], remote.psns[i],
                            self.psns[i], av, mtu, rd_atomic)
            try:
                qp.to_rts(attr)
            except PyverbsError as exc:
                raise VerbsError(f"QP {qp.qp_num} to RTS: {exc}") from exc

    def post_reads(self, queue: int, wr_id: int, ranges: np.ndarray, local: Region, remote: pb.RdmaRegion) -> None:
        """Post one chain of RDMA READs (ranges: int64 [k, 3] remote, local, length); only the last is signalled."""
        wrs = read_chain(wr_id, ranges, local, remote)
        if not wrs:
            return
        try:
            self._qps[queue].post_send(wrs[0])  # the provider copies the chain into the send queue
        except PyverbsError as exc:
            raise VerbsError(f"ibv_post_send on QP {self._qps[queue].qp_num}: {exc}") from exc

    def poll(self, max_entries: int = 32) -> list[Completion]:
        try:
            n, wcs = self.cq.poll(max_entries)
        except PyverbsError as exc:
            raise VerbsError(f"ibv_poll_cq: {exc}") from exc
        return [
            Completion(wc.wr_id, wc.status == e.IBV_WC_SUCCESS, wc.status, self._index.get(wc.qp_num, -1))
            for wc in wcs[:n]
        ]

    def close(self) -> None:
        """Destroy the queue pairs, then the completion queue."""
        for qp in self._qps:
            _close_quietly(qp)
        self._qps.clear()
        if self.cq is not None:
            _close_quietly(self.cq)
            self.cq = None


def ah_attr(av: AddressVector) -> AHAttr:
    """The address handle attributes: LID routing, or a global route header to the peer's GID."""
    if av.is_global:
        gr = GlobalRoute(dgid=GID(val=gid_to_str(av.dgid)), sgid_index=av.sgid_index, hop_limit=av.hop_limit)
        return AHAttr(port_num=av.port, is_global=1, gr=gr, dlid=av.dlid)
    return AHAttr(port_num=av.port, is_global=0, dlid=av.dlid)


def rts_attr(port_num: int, access: int, dest_qp_num: int, remote_psn: int, local_psn: int, av: AddressVector,
             mtu: int, rd_atomic: int) -> QPAttr:
    """Attributes for one RC queue pair's RESET/INIT -> RTR -> RTS transitions against its peer."""
    attr = QPAttr(port_num=port_num)
    attr.qp_access_flags = access
    attr.pkey_index = 0
    attr.path_mtu = mtu
    attr.dest_qp_num = dest_qp_num
    attr.rq_psn = remote_psn  # the PSN the peer sends from
    attr.sq_psn = local_psn
    attr.max_dest_rd_atomic = rd_atomic  # READs this side serves at once (responder)
    attr.max_rd_atomic = rd_atomic  # READs this side keeps in flight (requester)
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.timeout = ACK_TIMEOUT
    attr.retry_cnt = RETRY_COUNT
    attr.rnr_retry = RNR_RETRY
    attr.ah_attr = ah_attr(av)
    return attr


def read_chain(wr_id: int, ranges: np.ndarray, local: Region, remote: pb.RdmaRegion) -> list:
    """SendWRs of one chain of RDMA READs, linked by next_wr; only the last is signalled (and carries wr_id).

    The list must stay alive until post_send returns (next_wr links point into it).
    """
    wrs = []
    last = len(ranges) - 1
    for k, (r_off, l_off, length) in enumerate(np.asarray(ranges).tolist()):
        sge = SGE(local.addr + l_off, length, local.lkey)
        wr = SendWR(wr_id=wr_id if k == last else 0, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge],
                    send_flags=e.IBV_SEND_SIGNALED if k == last else 0)
        wr.set_wr_rdma(remote.rkey, remote.addr + r_off)
        if wrs:
            wrs[-1].next_wr = wr
        wrs.append(wr)
    return wrs


def _close_quietly(obj) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - teardown of a broken device must go on
        pass
