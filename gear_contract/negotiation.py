"""What a learner offers and what the daemon picks: the data-plane negotiation's shared rules.

The learner sends a ``DataPlaneOffer``: shared memory (with its host identity),
RDMA (with its device's endpoint: port, LID/GID, queue pairs) and inline bytes.
The daemon answers with the best plane both sides can use, in this order:

1. ``device`` when the learner is on the daemon's host, offers ``device`` (it has a GPU) and
   the table has a GPU mirror; else ``shm`` when the learner is on the daemon's host (same
   host identity),
2. ``rdma`` when both sides have an RDMA device (gear's own verbs code),
3. ``nixl`` when both sides have NIXL (``gear[nixl]``): the learner's agent READs
   the registered segment over UCX (InfiniBand, RoCE, EFA, or TCP without them),
4. ``stream`` when the daemon serves TCP bulk streams (windows sent with
   ``sendfile`` on several connections; another host without RDMA),
5. ``inline`` otherwise (bytes in gRPC messages).

Host identity: two processes can share the daemon's segments only when they run
on the same kernel (boot id). The network namespace counts too: a learner in
another namespace (a container, or ``ip netns exec`` in the tests) is treated
as a remote learner, which it is for everything but memory. The learner still
checks that it can open the segment (same /dev/shm, same user, mode 0600) and
falls back to the next plane if it cannot.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from collections.abc import Iterable

from gear_contract._proto import replay_pb2 as pb

DEVICE = "device"
SHM = "shm"
RDMA = "rdma"
NIXL = "nixl"
STREAM = "stream"
INLINE = "inline"
PLANES = (DEVICE, SHM, RDMA, NIXL, STREAM, INLINE)  # best first

# Pins the host identity (e.g. two containers that share /dev/shm and should use it).
ENV_HOST_ID = "GEAR_HOST_ID"


class NoCommonPlaneError(ValueError):
    """The learner offered nothing the daemon can serve."""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def local_host_id() -> str:
    """This process's host identity for the shm-plane decision (see module docstring).

    ``GEAR_HOST_ID`` overrides it. Otherwise a digest of the boot id (else the
    machine id), the host name and the network namespace.
    """
    pinned = os.environ.get(ENV_HOST_ID)
    if pinned:
        return pinned
    return _host_digest(os.getpid())


@functools.lru_cache(maxsize=4)
def _host_digest(pid: int) -> str:
    """The digest for process ``pid`` (worked out once per process: a writer asks at every connect)."""
    kernel = _read("/proc/sys/kernel/random/boot_id") or _read("/etc/machine-id")
    text = "|".join((kernel, socket.gethostname(), _namespace("net")))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def normalise_planes(planes: Iterable[str] | str | None) -> tuple[str, ...]:
    """Validate a learner's list of allowed planes (None: all), keeping the best-first order."""
    if planes is None:
        return PLANES
    if isinstance(planes, str):
        planes = [planes]
    wanted = {p.lower() for p in planes}
    unknown = wanted - set(PLANES)
    if unknown:
        raise ValueError(f"unknown data plane(s) {sorted(unknown)}; choose from {list(PLANES)}")
    if not wanted:
        raise ValueError("at least one data plane must be allowed")
    return tuple(p for p in PLANES if p in wanted)


def build_offer(planes: Iterable[str], host_id: str, rdma_endpoint: pb.RdmaEndpoint | None, *,
                device: bool = False) -> pb.DataPlaneOffer:
    """The learner's offer: the allowed planes it can actually use (``device``: it reads GPU mirrors)."""
    planes = set(planes)
    offer = pb.DataPlaneOffer(host_id=host_id, shm=SHM in planes, inline=INLINE in planes,
                              device=device and DEVICE in planes, stream=STREAM in planes, nixl=NIXL in planes)
    if RDMA in planes and rdma_endpoint is not None:
        offer.rdma.CopyFrom(rdma_endpoint)
    return offer


def choose_plane(offer: pb.DataPlaneOffer, daemon_host_id: str, daemon_has_rdma: bool,
                 table_mirrored: bool = False, *, daemon_has_stream: bool = False,
                 daemon_has_nixl: bool = False) -> str:
    """The daemon's pick: the best plane both sides support (NoCommonPlaneError if none)."""
    same_host = bool(offer.host_id) and offer.host_id == daemon_host_id
    if offer.device and same_host and table_mirrored:
        return DEVICE
    if offer.shm and same_host:
        return SHM
    if offer.HasField("rdma") and daemon_has_rdma:
        return RDMA
    if offer.nixl and daemon_has_nixl:
        return NIXL
    if offer.stream and daemon_has_stream:
        return STREAM
    if offer.inline:
        return INLINE
    offered = [name for name, ok in ((SHM, offer.shm), (RDMA, offer.HasField("rdma")), (NIXL, offer.nixl),
                                     (STREAM, offer.stream),
                                     (INLINE, offer.inline)) if ok]
    reasons = []
    if offer.shm:
        reasons.append("shm needs the learner on the daemon's host")
    if offer.HasField("rdma"):
        reasons.append("the daemon has no RDMA device")
    if offer.nixl:
        reasons.append("the daemon has no NIXL agent (gear[nixl] not installed or [data_planes] nixl = false)")
    if offer.stream:
        reasons.append("the daemon serves no streams ([data_planes] stream = false)")
    raise NoCommonPlaneError(
        f"no data plane in common: the learner offered {offered or 'nothing'}"
        + (f" ({'; '.join(reasons)})" if reasons else ""))
