"""The nixl plane: the learner's NIXL agent READs its leased items straight from the daemon's segment.

``OpenDataPlane`` answers ``nixl`` with the daemon agent's metadata and the table
segment it registered (``NixlRegion``: base address, length). The learner's own
agent loads that metadata; for each batch it plans the byte windows of the
selection (``range_planning``, as the other planes), checks that every window lies
inside the registered segment, and posts ONE transfer: a READ whose local
descriptor list addresses the batch buffer and whose remote list addresses the
segment. It polls the transfer to completion (an error or a timeout fails the
plane; the sampler falls back to the next one). The batch buffer is registered
with the agent once and reused: page-aligned host memory (DRAM), or GPU memory
(VRAM, a CuPy array) when the learner gathers for a GPU, so the bytes land on the
device without a host copy where UCX has GPUDirect (and through UCX's staging
otherwise). Leases and generations are the sampler's, as for every plane: a lease
that ended before the Release comes back stale and its batch is dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from gear_client.data_planes.batch import BufferPool, Pending, SampledBatch, column_arrays, page_aligned_empty
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
from gear_contract import nixl_agents
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0  # a READ not done within this fails the plane
SPIN_POLLS = 64  # completion checks before the poll loop starts sleeping between them
POLL_SLEEP_S = 50e-6


class NixlReadError(nixl_agents.NixlTransferError):
    """A READ was refused or failed (a window outside the segment, the daemon's agent gone, a transfer error)."""


class NixlPlane:
    """Batches READ by the learner's NIXL agent (see module docstring)."""

    kind = "nixl"

    def __init__(self, session: PlaneSession, layout: TableLayout | None, region: pb.NixlRegion | None, *,
                 device: Any = None, agent: Any = None, timeout_s: float = TRANSFER_TIMEOUT_S,
                 columns: ColumnChoice | None = None):
        self.session = session
        self.layout = layout
        self.columns = columns  # read only these columns' windows (None: all)
        self.bytes_moved = 0  # bytes READ from the daemon's segment
        self.device = device
        self.timeout_s = timeout_s
        self.agent = agent if agent is not None else nixl_agents.new_agent("learner")
        self.gpu = is_gpu_device(device)
        self.region: pb.NixlRegion | None = None
        self._remote: str | None = None
        self._metadata: bytes | None = None
        self._registered: dict[int, Any] = {}  # buffer address -> the agent's registration list
        self._pool = BufferPool(allocate=self._allocate, forget=self._forget)
        self.transfers = 0  # READ transfers posted (one per batch)
        if region is not None:
            self._load(region)

    # ------------------------------------------------------------------ remote agent
    def _load(self, region: pb.NixlRegion) -> None:
        """Load the daemon agent's metadata (again when it changed: a new segment was registered)."""
        if not region.agent_metadata or not region.agent:
            raise NixlReadError("the daemon sent a nixl region without its agent's metadata")
        if region.mem_type and region.mem_type != nixl_agents.DRAM:
            raise NixlReadError(f"the daemon registered its segment as {region.mem_type!r}; DRAM expected")
        if region.agent_metadata != self._metadata:
            if self._remote is not None:
                self.agent.remove_remote_agent(self._remote)
                self._remote = None
            name = self.agent.add_remote_agent(region.agent_metadata)
            self._remote = name.decode() if isinstance(name, bytes) else str(name)
            self._metadata = region.agent_metadata
        self.region = region

    def set_layout(self, layout: TableLayout, region: pb.NixlRegion | None) -> None:
        """The table's layout changed: READ the new segment (its registration came with the layout)."""
        if region is None:
            raise NixlReadError("the daemon sent a new layout without its nixl region")
        self._load(region)
        self.layout = layout

    # ------------------------------------------------------------------ buffers
    def _allocate(self, nbytes: int) -> Any:
        """A batch buffer registered with the agent: GPU memory (VRAM) for a GPU learner, else page-aligned DRAM."""
        nbytes = max(nbytes, 1)
        if self.gpu:
            import cupy as cp

            with cp.cuda.Device(self._device_id()):
                buf = cp.empty(nbytes, dtype=cp.uint8)
            address = int(buf.data.ptr)
            descs = self.agent.register_memory([(address, nbytes, self._device_id(), "")], nixl_agents.VRAM)
        else:
            buf = page_aligned_empty(nbytes)
            address = int(buf.ctypes.data)
            descs = self.agent.register_memory([(address, nbytes, 0, "")], nixl_agents.DRAM)
        self._registered[address] = descs
        return buf

    def _device_id(self) -> int:
        if isinstance(self.device, int) and not isinstance(self.device, bool):
            return self.device
        index = getattr(self.device, "id", None)
        if index is None and isinstance(self.device, str) and ":" in self.device:
            index = int(self.device.rsplit(":", 1)[1])
        return int(index or 0)

    def _address(self, buf: Any) -> int:
        return int(buf.data.ptr) if self.gpu else int(buf.ctypes.data)

    def _forget(self, buf: Any) -> None:
        """Deregister a buffer no READ targets any more (a batch that views it keeps its memory)."""
        descs = self._registered.pop(self._address(buf), None)
        if descs is not None:
            self.agent.deregister_memory(descs)

    # ------------------------------------------------------------------ reads
    def pipelined(self) -> None:
        """Nothing changes: a batch's READ completes within start()."""

    def cancel(self) -> None:
        """Nothing to end: a READ in flight completes or times out within fetch()."""

    def start(self, selection: ItemSelection, window: WindowSpec) -> Pending:
        return Pending(None, self.fetch(selection, window))

    def fetch(self, selection: ItemSelection, window: WindowSpec) -> SampledBatch:
        layout, lengths = narrowed(self.columns, self.layout, selection.lengths)
        n = len(selection)
        windows = resolve_windows(layout, window)
        batch = BatchLayout.build(layout, n, window_steps(windows))
        starts, counts, firsts = window_bounds(lengths, layout, windows)
        ranges = plan_ranges(layout, selection.slots, starts, counts, batch, firsts)
        buf = self._pool.get(batch.nbytes)
        if len(ranges):
            self.read(ranges, self._address(buf))
            self.bytes_moved += int(ranges[:, LENGTH].sum())
        for off, length in padding_ranges(counts, batch, firsts).tolist():
            buf[off:off + length] = 0
        keys, probs, sizes, prios, times = selection.infos
        xp = np
        if self.gpu:
            import cupy as xp
        return SampledBatch(keys, probs, sizes, prios, times, column_arrays(buf, layout, batch, n, xp),
                            counts.astype(np.int32), layout.structure, tuple(c.squeeze for c in layout.columns),
                            plane=self.kind)

    def read(self, ranges: np.ndarray, local_base: int) -> None:
        """READ ``ranges`` (``[n, 3]``: buffer offset, segment offset, length) in one transfer and wait for it.

        NixlReadError for a window outside the registered segment (nothing is posted),
        a transfer the agents refuse, one that fails, or one not done within the timeout.
        """
        region = self.region
        if region is None or self._remote is None:
            raise NixlReadError("no nixl region loaded (the daemon sent none)")
        remote_off = ranges[:, REMOTE].astype(np.int64)
        lengths = ranges[:, LENGTH].astype(np.int64)
        if int(remote_off.min()) < 0 or int((remote_off + lengths).max()) > region.length or int(lengths.min()) <= 0:
            raise NixlReadError("a selected window lies outside the daemon's registered segment")
        local = nixl_agents.descriptors(local_base + ranges[:, LOCAL].astype(np.uint64), lengths,
                                        self._device_id() if self.gpu else 0)
        remote = nixl_agents.descriptors(region.addr + remote_off.astype(np.uint64), lengths, region.device_id)
        agent = self.agent
        mem = nixl_agents.VRAM if self.gpu else nixl_agents.DRAM
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem),
                                           agent.get_xfer_descs(remote, region.mem_type or nixl_agents.DRAM),
                                           self._remote)
        except Exception as exc:  # noqa: BLE001 - the binding's own error types
            raise NixlReadError(f"the NIXL agent refused the READ: {exc}") from exc
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.timeout_s
            polls = 0
            while state == "PROC":
                polls += 1
                if polls > SPIN_POLLS:  # past a short spin, leave the cores to UCX's progress thread
                    if time.monotonic() > deadline:
                        raise NixlReadError(f"a NIXL READ did not complete within {self.timeout_s:g} s")
                    time.sleep(POLL_SLEEP_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlReadError(f"a NIXL READ failed ({state})")
            self.transfers += 1
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - a handle of a failed transfer: released with the agent
                log.debug("releasing a NIXL transfer handle failed", exc_info=True)

    def close(self) -> None:
        self._pool.clear()
        for descs in self._registered.values():
            try:
                self.agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                log.debug("deregistering a NIXL buffer failed", exc_info=True)
        self._registered.clear()
        if self._remote is not None:
            try:
                self.agent.remove_remote_agent(self._remote)
            except Exception:  # noqa: BLE001
                log.debug("removing the daemon's NIXL agent failed", exc_info=True)
            self._remote = None
