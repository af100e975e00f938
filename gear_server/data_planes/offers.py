"""Which data planes the daemon offers learners, and for each one it does not, why (logged at start)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gear_contract.negotiation import INLINE, NIXL, PLANES, RDMA, SHM, STREAM


@dataclass(frozen=True)
class PlaneReport:
    """The planes offered (best first) and a reason for each plane or accelerator that is off."""

    offered: tuple[str, ...]
    off: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """One log line: ``data planes offered: shm, inline; off: rdma (no RDMA device), gpu (...)``."""
        text = "data planes offered: " + ", ".join(self.offered)
        if self.off:
            text += "; off: " + ", ".join(f"{name} ({why})" for name, why in self.off.items())
        return text


def plane_report(rdma_off: str | None, gpu_off: str | None = None, stream_off: str | None = None,
                 nixl_off: str | None = None) -> PlaneReport:
    """The report for a daemon whose RDMA plane is off for ``rdma_off``, stream plane for ``stream_off`` and
    nixl plane for ``nixl_off`` (None: on).

    shm and inline need nothing beyond the daemon itself (its tables live in
    shared memory). ``gpu_off`` says why the GPU kernels (selection offload,
    the learners' GPU gather on this host) are off, None when a GPU is usable.
    """
    offered = tuple(p for p in PLANES if p in (SHM, INLINE) or (p == RDMA and rdma_off is None)
                    or (p == STREAM and stream_off is None) or (p == NIXL and nixl_off is None))
    off: dict[str, str] = {}
    if rdma_off is not None:
        off[RDMA] = rdma_off
    if nixl_off is not None:
        off[NIXL] = nixl_off
    if stream_off is not None:
        off[STREAM] = stream_off
    if gpu_off is not None:
        off["gpu"] = gpu_off
    return PlaneReport(offered, off)


def gpu_off_reason() -> str | None:
    """Why the GPU kernels cannot run in this process (None: CuPy and a CUDA GPU are usable)."""
    from gear_kernels import gpu_available

    return None if gpu_available() else "no GPU: CuPy or a CUDA device is missing"
