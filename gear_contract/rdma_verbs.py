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

import importlib
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
    responder_depth,
)

# The verbs constants this module uses: where pyverbs >= 59 keeps them (an enum class of
# pyverbs.libibverbs_enums; None: an anonymous enum, a module attribute) and their field here.
_ENUMS = {
    "IBV_PORT_ACTIVE": ("ibv_port_state", "port_active"),
    "IBV_LINK_LAYER_ETHERNET": (None, "link_layer_ethernet"),
    "IBV_GID_TYPE_SYSFS_ROCE_V2": ("ibv_gid_type_sysfs", "gid_type_roce_v2"),
    "IBV_ACCESS_LOCAL_WRITE": ("ibv_access_flags", "access_local_write"),
    "IBV_ACCESS_REMOTE_READ": ("ibv_access_flags", "access_remote_read"),
    "IBV_QPT_RC": ("ibv_qp_type", "qpt_rc"),
    "IBV_WC_SUCCESS": ("ibv_wc_status", "wc_success"),
    "IBV_WR_RDMA_READ": ("ibv_wr_opcode", "wr_rdma_read"),
    "IBV_SEND_SIGNALED": ("ibv_send_flags", "send_signaled"),
}
NEW_ENUMS_MODULE = "pyverbs.libibverbs_enums"  # rdma-core >= 59
OLD_ENUMS_MODULE = "pyverbs.enums"  # rdma-core < 59


@dataclass(frozen=True)
class VerbsEnums:
    """The libibverbs constants this module passes to pyverbs, as plain integers."""

    port_active: int
    link_layer_ethernet: int
    gid_type_roce_v2: int
    access_local_write: int
    access_remote_read: int
    qpt_rc: int
    wc_success: int
    wr_rdma_read: int
    send_signaled: int
    source: str  # the module they came from


class PyverbsTooOldError(ImportError):
    """pyverbs imports but has neither enum module, or lacks a constant this module needs."""


def _lookup(module, name: str, enum_class: str | None) -> int | None:
    value = getattr(module, name, None)  # a module-level constant (pyverbs.enums, anonymous enums)
    if value is None and enum_class is not None:
        value = getattr(getattr(module, enum_class, None), name, None)  # an enum class member (>= 59)
    return None if value is None else int(value)


def resolve_enums() -> VerbsEnums:
    """The constants from ``pyverbs.libibverbs_enums`` (rdma-core >= 59) or ``pyverbs.enums`` (older).

    ModuleNotFoundError when pyverbs is absent; PyverbsTooOldError when it has
    neither module or lacks a constant (the message names them).
    """
    importlib.import_module("pyverbs")
    tried = []
    for module_name in (NEW_ENUMS_MODULE, OLD_ENUMS_MODULE):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            tried.append(f"{module_name}: {exc}")
            continue
        values = {field: _lookup(module, name, enum_class) for name, (enum_class, field) in _ENUMS.items()}
        missing = [name for name, (_, field) in _ENUMS.items() if values[field] is None]
        if missing:
            raise PyverbsTooOldError(f"{module_name} lacks {', '.join(missing)}")
        return VerbsEnums(**values, source=module_name)
    raise PyverbsTooOldError("pyverbs has no enum module (" + "; ".join(tried) + ")")


def _import_failure(exc: BaseException) -> str:
    """Why pyverbs cannot be used, for the daemon's start-up line and the learner's fallback."""
    if isinstance(exc, PyverbsTooOldError):
        return f"pyverbs too old or incomplete ({exc})"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "pyverbs":
        return "pyverbs missing (install the distribution's python3-pyverbs, docs/DATA_PLANES.md)"
    return f"pyverbs not importable ({type(exc).__name__}: {exc})"


try:  # pyverbs is an optional extra; importing it may also fail on a libibverbs ABI mismatch.
    E = resolve_enums()
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
except (ImportError, OSError) as _exc:  # pragma: no cover - depends on the machine
    _IMPORT_ERROR: str | None = _import_failure(_exc)
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
# Lossless RoCE: the service level (IB SL; the priority a RoCE NIC maps it to) and the IP
# traffic class (DSCP << 2 | ECN) of this side's packets: the PFC-protected class, say.
ENV_SERVICE_LEVEL = "GEAR_RDMA_SL"
ENV_TRAFFIC_CLASS = "GEAR_RDMA_TRAFFIC_CLASS"


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
    return GID_TYPE_ROCE_V2 if kind == E.gid_type_roce_v2 else GID_TYPE_ROCE_V1


def _port_info(ctx, device: str, port: int, gid_index: int | None, service_level: int = 0,
               traffic_class: int = 0) -> PortInfo | None:
    attr = ctx.query_port(port)
    if attr.state != E.port_active:
        return None
    link = LINK_ETHERNET if attr.link_layer == E.link_layer_ethernet else LINK_IB
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
        max_qp_init_rd_atom=dev.max_qp_init_rd_atom, service_level=service_level, traffic_class=traffic_class,
    )


def _env_int(name: str, low: int, high: int) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = int(text, 0)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: must be in [{low}, {high}]")
    return value


def probe(device: str | None = None, port: int | None = None, gid_index: int | None = None,
          service_level: int | None = None, traffic_class: int | None = None) -> PortInfo | None:
    """The first active port (of ``device``, or of any device), or None.

    ``GEAR_RDMA_DEVICE``, ``GEAR_RDMA_PORT``, ``GEAR_RDMA_GID_INDEX``,
    ``GEAR_RDMA_SL`` and ``GEAR_RDMA_TRAFFIC_CLASS`` pin the choice when
    arguments are not given (ValueError for a value out of range).
    """
    device = device or os.environ.get(ENV_DEVICE) or None
    port = port or _env_int(ENV_PORT, 1, 255)
    gid_index = gid_index if gid_index is not None else _env_int(ENV_GID_INDEX, 0, 65535)
    service_level = service_level if service_level is not None else _env_int(ENV_SERVICE_LEVEL, 0, 15) or 0
    traffic_class = traffic_class if traffic_class is not None else _env_int(ENV_TRAFFIC_CLASS, 0, 255) or 0
    if not 0 <= service_level <= 15 or not 0 <= traffic_class <= 255:
        raise ValueError(f"RDMA service level must be in [0, 15] and traffic class in [0, 255], got "
                         f"{service_level} and {traffic_class}")
    if _IMPORT_ERROR is not None:
        return None
    names = [device] if device else device_names()
    for name in names:
        try:
            ctx = Context(name=name)
        except PyverbsError:
            continue
        try:
            ports = [port] if port else range(1, ctx.query_device().phys_port_cnt + 1)
            for p in ports:
                info = _port_info(ctx, name, p, gid_index, service_level, traffic_class)
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
        return E.access_remote_read if self.responder else E.access_local_write

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
            init = QPInitAttr(qp_type=E.qpt_rc, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
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
        """INIT -> RTR -> RTS, queue pair i against the peer's queue pair i.

        ``rd_atomic``: READs each QP issues at once (addressing.rd_atomic); it
        serves as many as this device's endpoint advertised (responder_depth).
        """
        if len(remote.qp_nums) != len(self._qps):
            raise VerbsError(f"peer has {len(remote.qp_nums)} queue pairs, this side {len(self._qps)}")
        port = self.device.port
        for i, qp in enumerate(self._qps):
            attr = rts_attr(port.port, self.device.access, remote.qp_nums[i], remote.psns[i],
                            self.psns[i], av, mtu, rd_atomic, dest_rd_atomic=responder_depth(port))
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
            Completion(wc.wr_id, wc.status == E.wc_success, wc.status, self._index.get(wc.qp_num, -1))
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
        gr = GlobalRoute(dgid=GID(val=gid_to_str(av.dgid)), sgid_index=av.sgid_index, hop_limit=av.hop_limit,
                         traffic_class=av.traffic_class)
        return AHAttr(port_num=av.port, is_global=1, gr=gr, dlid=av.dlid, sl=av.sl)
    return AHAttr(port_num=av.port, is_global=0, dlid=av.dlid, sl=av.sl)


def rts_attr(port_num: int, access: int, dest_qp_num: int, remote_psn: int, local_psn: int, av: AddressVector,
             mtu: int, rd_atomic: int, dest_rd_atomic: int | None = None) -> QPAttr:
    """Attributes for one RC queue pair's RESET/INIT -> RTR -> RTS transitions against its peer.

    ``rd_atomic``: READs issued at once (requester); ``dest_rd_atomic``: READs
    served at once (responder; default ``rd_atomic``).
    """
    attr = QPAttr(port_num=port_num)
    attr.qp_access_flags = access
    attr.pkey_index = 0
    attr.path_mtu = mtu
    attr.dest_qp_num = dest_qp_num
    attr.rq_psn = remote_psn  # the PSN the peer sends from
    attr.sq_psn = local_psn
    attr.max_dest_rd_atomic = rd_atomic if dest_rd_atomic is None else dest_rd_atomic  # served at once
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
        wr = SendWR(wr_id=wr_id if k == last else 0, opcode=E.wr_rdma_read, num_sge=1, sg=[sge],
                    send_flags=E.send_signaled if k == last else 0)
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
