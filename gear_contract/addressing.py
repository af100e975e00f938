"""RDMA addressing and queue-pair parameters, as plain data (no pyverbs here).

Both sides of an RDMA data plane describe themselves with a ``PortInfo`` (what
``verbs.probe`` found) and exchange ``gear.v1.RdmaEndpoint`` messages over the
control plane. This module decides, from the two endpoints, how a queue pair
reaches its peer: LID routing on InfiniBand, a global route header with the
peer's GID on RoCE (Ethernet link layer) or across IB subnets; the path MTU;
how many RDMA READs may be outstanding. Keeping these choices out of verbs.py
lets them be tested where no RDMA device exists.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from gear_contract._proto import replay_pb2 as pb

LINK_IB = "IB"
LINK_ETHERNET = "Ethernet"

# ibv_mtu enum values -> bytes
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
# Outstanding RDMA READ/atomic operations a QP may have; devices commonly allow 16.
DEFAULT_MAX_RD_ATOMIC = 16
# RoCE GID types as ibv_query_gid_type reports them (sysfs names).
GID_TYPE_IB = "IB"
GID_TYPE_ROCE_V1 = "RoCE v1"
GID_TYPE_ROCE_V2 = "RoCE v2"


def gid_to_bytes(gid: str | bytes) -> bytes:
    """16 raw bytes of a GID given as pyverbs prints it ('fe80:0000:...:0001') or raw."""
    if isinstance(gid, (bytes, bytearray)):
        if len(gid) != 16:
            raise ValueError(f"a GID is 16 bytes, got {len(gid)}")
        return bytes(gid)
    text = gid.strip()
    if ":" in text and len(text.replace(":", "")) == 32:
        return bytes.fromhex(text.replace(":", ""))
    return ipaddress.IPv6Address(text).packed


def gid_to_str(gid: bytes) -> str:
    """The eight 4-digit groups pyverbs' GID(val=...) takes."""
    raw = gid_to_bytes(gid)
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def is_zero_gid(gid: bytes) -> bool:
    return not any(gid_to_bytes(gid)[8:])


def is_ipv4_mapped(gid: bytes) -> bool:
    raw = gid_to_bytes(gid)
    return raw[:10] == b"\x00" * 10 and raw[10:12] == b"\xff\xff"


def subnet_prefix(gid: bytes) -> bytes:
    return gid_to_bytes(gid)[:8]


@dataclass(frozen=True)
class GidEntry:
    """One entry of a port's GID table."""

    index: int
    gid: bytes
    gid_type: str = GID_TYPE_IB


def choose_gid_index(entries: Iterable[GidEntry], link_layer: str) -> int:
    """The GID index to source packets from; -1 when none is usable.

    InfiniBand: the first non-zero GID (index 0, the port GID, in practice).
    RoCE: RoCE v2 (routable over UDP/IP) before v1, IPv4-mapped addresses before
    IPv6 ones (the usual data-centre set-up), lowest index last.
    """
    usable = [e for e in entries if not is_zero_gid(e.gid)]
    if not usable:
        return -1
    if link_layer != LINK_ETHERNET:
        return min(usable, key=lambda e: e.index).index

    def rank(e: GidEntry) -> tuple[int, int, int]:
        version = 0 if e.gid_type == GID_TYPE_ROCE_V2 else 1
        family = 0 if is_ipv4_mapped(e.gid) else 1
        return (version, family, e.index)

    return min(usable, key=rank).index


@dataclass(frozen=True)
class PortInfo:
    """An active port of a local RDMA device, as probed."""

    device: str
    port: int
    link_layer: str  # LINK_IB or LINK_ETHERNET
    lid: int
    gid: bytes  # the chosen source GID (16 zero bytes when none)
    gid_index: int  # -1 when none
    active_mtu: int  # ibv_mtu enum
    max_msg_size: int
    max_qp_rd_atom: int = DEFAULT_MAX_RD_ATOMIC
    max_qp_wr: int = 4096
    max_cqe: int = 65536
    gids: tuple[GidEntry, ...] = field(default=(), compare=False)
    max_qp_init_rd_atom: int = DEFAULT_MAX_RD_ATOMIC  # READs a QP of this device may issue at once
    service_level: int = 0  # SL of this side's packets (lossless RoCE: the PFC priority's)
    traffic_class: int = 0  # IP traffic class of this side's packets on RoCE (DSCP << 2)

    def endpoint(self, qp_nums: Iterable[int], psns: Iterable[int]) -> pb.RdmaEndpoint:
        """This side's half of the queue-pair exchange."""
        return pb.RdmaEndpoint(
            device=self.device, port=self.port, link_layer=self.link_layer, lid=self.lid,
            gid=self.gid, gid_index=self.gid_index, mtu=self.active_mtu,
            qp_nums=list(qp_nums), psns=list(psns),
            max_rd_atomic=responder_depth(self), max_msg_size=self.max_msg_size,
        )


@dataclass(frozen=True)
class AddressVector:
    """How a local queue pair addresses its remote peer (ibv_ah_attr)."""

    port: int
    is_global: bool
    dlid: int
    dgid: bytes  # used when is_global
    sgid_index: int
    hop_limit: int = 64
    sl: int = 0
    traffic_class: int = 0


def validate_endpoint(remote: pb.RdmaEndpoint, expected_qps: int | None = None) -> None:
    """Reject an endpoint that cannot be connected to (ValueError naming the problem)."""
    if remote.link_layer not in (LINK_IB, LINK_ETHERNET):
        raise ValueError(f"unknown RDMA link layer {remote.link_layer!r}")
    if len(remote.qp_nums) == 0:
        raise ValueError("RDMA endpoint has no queue pairs")
    if len(remote.qp_nums) != len(remote.psns):
        raise ValueError("RDMA endpoint: one PSN per queue pair is needed")
    if expected_qps is not None and len(remote.qp_nums) != expected_qps:
        raise ValueError(f"RDMA endpoint has {len(remote.qp_nums)} queue pairs, expected {expected_qps}")
    if any(q == 0 or q >= 1 << 24 for q in remote.qp_nums):
        raise ValueError("RDMA queue-pair numbers are 24-bit and non-zero")
    if any(p >= 1 << 24 for p in remote.psns):
        raise ValueError("RDMA PSNs are 24-bit")
    if remote.mtu not in MTU_BYTES:
        raise ValueError(f"RDMA endpoint: unknown MTU enum {remote.mtu}")
    if remote.gid and len(remote.gid) != 16:
        raise ValueError("RDMA endpoint: a GID is 16 bytes")
    if remote.link_layer == LINK_ETHERNET and (not remote.gid or is_zero_gid(remote.gid)):
        raise ValueError("RoCE endpoint without a GID")
    if remote.link_layer == LINK_IB and remote.lid == 0 and (not remote.gid or is_zero_gid(remote.gid)):
        raise ValueError("InfiniBand endpoint with neither a LID nor a GID")


def address_vector(local: PortInfo, remote: pb.RdmaEndpoint) -> AddressVector:
    """Route to the peer: LID on one IB subnet, GRH + GID on RoCE and across IB subnets."""
    if local.link_layer != remote.link_layer:
        raise ValueError(f"link layers differ: local {local.link_layer}, remote {remote.link_layer}")
    remote_gid = bytes(remote.gid) if remote.gid else bytes(16)
    if local.link_layer == LINK_ETHERNET:
        if local.gid_index < 0:
            raise ValueError(f"{local.device} port {local.port}: no usable RoCE GID")
        return AddressVector(local.port, True, 0, remote_gid, local.gid_index, sl=local.service_level,
                             traffic_class=local.traffic_class)
    other_subnet = (
        not is_zero_gid(remote_gid) and local.gid_index >= 0
        and subnet_prefix(remote_gid) != subnet_prefix(local.gid)
    )
    is_global = remote.lid == 0 or other_subnet
    return AddressVector(local.port, is_global, remote.lid, remote_gid, max(local.gid_index, 0),
                         sl=local.service_level, traffic_class=local.traffic_class)


def path_mtu(local: PortInfo, remote: pb.RdmaEndpoint) -> int:
    """The smaller of the two ports' active MTUs (ibv_mtu enum)."""
    return min(local.active_mtu, remote.mtu or local.active_mtu)


def rd_atomic(local: PortInfo, remote: pb.RdmaEndpoint) -> int:
    """READs this side's QP keeps in flight as requester (its max_rd_atomic).

    Bounded by what this device may initiate (max_qp_init_rd_atom) and by what
    the peer serves at once (its advertised responder depth).
    """
    theirs = remote.max_rd_atomic or 1
    return max(1, min(local.max_qp_init_rd_atom, theirs, DEFAULT_MAX_RD_ATOMIC))


def responder_depth(local: PortInfo) -> int:
    """READs this side's QP serves at once as responder (max_dest_rd_atomic; what its endpoint advertises)."""
    return max(1, min(local.max_qp_rd_atom, DEFAULT_MAX_RD_ATOMIC))


def max_message(local: PortInfo, remote: pb.RdmaEndpoint) -> int:
    """The largest single RDMA READ both ports accept."""
    sizes = [s for s in (local.max_msg_size, remote.max_msg_size) if s > 0]
    return min(sizes) if sizes else 1 << 30
