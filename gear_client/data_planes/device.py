"""The device plane: a learner on the daemon's host reads a table's GPU mirror through CUDA IPC.

A table configured with ``gpu_mirror`` keeps its most recent items' rows in one
GPU's memory (``gear_server.table.gpu_mirror``). A learner that offers
``device`` (``DataPlaneOffer.device``) on the daemon's host gets a ``device``
session: the OpenDataPlane answer carries the mirror's CUDA IPC handle, and
every Select answer lists each item's mirror row (-1 where the mirror does not
hold that item's generation). ``DeviceTierReader`` gathers a selection into one
``[n, row_bytes]`` batch of slot rows: the mirrored items with ``cupy.take``
from the mirror (HBM speed on the mirror's GPU, NVLink/peer reads from another
GPU), the rest from the table segment mapped and registered with CUDA (the
zero-copy host path of the shm plane), in the same batch. ``columns`` views the
batch per column. The lease the Select took keeps every row it read intact;
``release`` says whether the lease was still good (not stale).

With the host stand-in backend (daemon without a GPU: ``backend = "host"``) the
mirror is a file under /dev/shm and the same reader gathers with NumPy.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Any

import numpy as np

from gear_client.data_planes.session import ItemSelection, PendingSelect, PlaneSession
from gear_client.data_planes.shm import SegmentMapping, ShmPlane, gpu_index
from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def row_bytes(layout: TableLayout) -> int:
    """Bytes of one slot row (every column of one item): the layout's slot stride."""
    return int(layout.columns[0].slot_stride) if layout.columns else 0


def columns(rows: Any, layout: TableLayout) -> list[Any]:
    """Per column, ``[n, max_length, *shape]`` views of a ``[n, row_bytes]`` batch (NumPy or CuPy; no copy).

    Steps past an item's length are whatever its slot row holds (the lengths say which are its own).
    """
    out = []
    n = rows.shape[0]
    for col in layout.columns:
        nbytes = int(col.step_bytes) * int(col.max_length)
        piece = rows[:, col.offset: col.offset + nbytes]
        out.append(piece.view(col.dtype).reshape(n, int(col.max_length), *col.shape))
    return out


class HostMirror:
    """The host stand-in mirror: its file mapped read-only."""

    def __init__(self, tier: pb.DeviceTier):
        fd = os.open(tier.host_path, os.O_RDONLY)
        try:
            self._mmap = mmap.mmap(fd, int(tier.nbytes), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self._mmap, np.uint8)

    def rows(self, row_size: int) -> np.ndarray:
        return self.bytes[: (len(self.bytes) // row_size) * row_size].reshape(-1, row_size)

    def close(self) -> None:
        self.bytes = None
        try:
            self._mmap.close()
        except BufferError:
            pass


class CudaMirror:
    """The daemon's GPU mirror opened through CUDA IPC on the learner's GPU ``device`` (peer access if another)."""

    def __init__(self, tier: pb.DeviceTier, device: int):
        from gear_kernels.backend import require_cupy

        cp = require_cupy()
        self.cp = cp
        self.device = device
        self.nbytes = int(tier.nbytes)
        with cp.cuda.Device(device):
            self.ptr = int(cp.cuda.runtime.ipcOpenMemHandle(tier.ipc_handle, IPC_LAZY_ENABLE_PEER_ACCESS))
            memory = cp.cuda.UnownedMemory(self.ptr, self.nbytes, self, device_id=device)
            self.bytes = cp.ndarray((self.nbytes,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))

    def rows(self, row_size: int) -> Any:
        return self.bytes[: (self.nbytes // row_size) * row_size].reshape(-1, row_size)

    def close(self) -> None:
        if self.bytes is None:
            return
        self.bytes = None
        with self.cp.cuda.Device(self.device):
            self.cp.cuda.runtime.deviceSynchronize()
            self.cp.cuda.runtime.ipcCloseMemHandle(self.ptr)


def windows_of(windows: list[Any], mask: np.ndarray) -> list[Any]:
    """The windows of the items ``mask`` picks: per-item starts cut to them, the rest as they are."""
    out = []
    for w in windows:
        if np.ndim(w.start) == 0:
            out.append(w)
        else:
            starts = w.start.get() if hasattr(w.start, "get") else np.asarray(w.start)
            out.append(dataclasses.replace(w, start=starts[mask]))
    return out


@dataclasses.dataclass(frozen=True)
class MirrorSource:
    """The mirror as a source for the gather kernel (what a ``HostRegistration`` gives it: a pointer, a size).

    ``size`` adds one row to the buffer's: a layout's ``segment_size`` counts its last column's offset past the
    last row, but the kernel reads only inside rows ``[0, capacity)``.
    """

    device_ptr: int
    size: int


class DevicePlane(ShmPlane):
    """The device plane for ``PlaneSampler`` (a learner with ``device="cuda"``): the shm plane's GPU gather,
    with each batch's mirrored items read from the mirror (the same kernel, rows for slots) and the rest
    from the registered segment, joined on the device. GPU only."""

    kind = negotiation.DEVICE

    def __init__(self, session: PlaneSession, layout: TableLayout | None, tier: pb.DeviceTier, *, device: Any,
                 columns: Any = None):
        if tier.host_path:
            raise RuntimeError("the daemon's mirror is its host stand-in: use the shm plane")
        super().__init__(session, layout, device=device, columns=columns)
        if not self._gpu:
            raise RuntimeError("the device plane reads into GPU memory: give the sampler device='cuda'")
        self.mirror = CudaMirror(tier, gpu_index(device))

    def _gather_batch(self, layout: TableLayout, selection: ItemSelection, lengths: np.ndarray, windows) -> Any:
        from gear_kernels.gather import Batch, GatherPlan

        rows = selection.mirror_rows
        hit = rows >= 0 if rows is not None else np.zeros(len(selection), bool)
        if not hit.any():
            return super()._gather_batch(layout, selection, lengths, windows)
        size = row_bytes(layout)
        mirror_layout = dataclasses.replace(layout, capacity=self.mirror.nbytes // size)
        source = MirrorSource(self.mirror.ptr, self.mirror.nbytes + size)
        if hit.all():
            return GatherPlan(mirror_layout, source, rows, lengths, windows).launch()
        cp = self.mirror.cp
        mirrored = GatherPlan(mirror_layout, source, rows[hit], lengths[hit], windows_of(windows, hit)).launch()
        rest = dataclasses.replace(selection, slots=selection.slots[~hit])
        segment = super()._gather_batch(layout, rest, lengths[~hit], windows_of(windows, ~hit))
        at_hit, at_rest = cp.asarray(np.flatnonzero(hit)), cp.asarray(np.flatnonzero(~hit))
        columns = []
        for a, b in zip(mirrored.columns, segment.columns, strict=True):
            joined = cp.empty((len(hit), *a.shape[1:]), a.dtype)
            joined[at_hit] = a
            joined[at_rest] = b
            columns.append(joined)
        joined_lengths = cp.empty((len(hit), mirrored.lengths.shape[1]), cp.int32)
        joined_lengths[at_hit] = mirrored.lengths
        joined_lengths[at_rest] = segment.lengths
        return Batch(columns, joined_lengths, None, mirrored.column_indices)

    def close(self) -> None:
        super().close()
        self.mirror.close()


class DeviceTierReader:
    """A device-plane session on one table: Select, gather (mirror + segment), Release.

    ``stub``: a ``GearReplay`` stub to the daemon on this host. ``device``: the learner's CUDA GPU
    (None: the current one). RuntimeError when the daemon does not answer with a device session
    (the table has no mirror, or the learner is not on its host).
    """

    def __init__(self, stub: Any, table: str, *, device: int | None = None, metadata: Any = None):
        offer = pb.DataPlaneOffer(host_id=negotiation.local_host_id(), shm=True, device=True)
        response = stub.OpenDataPlane(pb.OpenDataPlaneRequest(table=table, offer=offer), metadata=metadata)
        if response.kind != negotiation.DEVICE:
            if response.session_id:
                stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=response.session_id), metadata=metadata)
            raise RuntimeError(f"table '{table}': the daemon answered a {response.kind!r} session, not a device one "
                               "(no gpu_mirror, or this learner is not on the daemon's host)")
        self.session = PlaneSession(stub, table, response, metadata=metadata)
        tier = response.device_tier
        self.on_gpu = not tier.host_path
        self._cp: Any = None
        try:
            if self.on_gpu:
                from gear_kernels.backend import require_cupy

                self._cp = require_cupy()
                self.device = self._cp.cuda.Device().id if device is None else int(device)
                self.mirror: HostMirror | CudaMirror = CudaMirror(tier, self.device)
            else:
                self.device = -1
                self.mirror = HostMirror(tier)
        except BaseException:
            self.session.close()
            raise
        self.mirror_device = int(tier.device)
        self.layout: TableLayout | None = None
        self._mapping: SegmentMapping | None = None
        self._registration: Any = None
        if response.HasField("layout"):
            self._follow(TableLayout.from_proto(response.layout))

    def _follow(self, layout: TableLayout) -> None:
        """Read ``layout``'s segment from now on."""
        self._drop_segment()
        self._mapping = SegmentMapping(layout)
        self.layout = layout
        if self.on_gpu:
            from gear_kernels import HostRegistration

            with self._cp.cuda.Device(self.device):
                self._registration = HostRegistration(self._mapping.buffer)

    def _drop_segment(self) -> None:
        if self._registration is not None:
            with self._cp.cuda.Device(self.device):
                self._cp.cuda.runtime.deviceSynchronize()
                self._registration.close()
            self._registration = None
        self._mapping = None

    def select(self, num_samples: int, timeout: float | None = None) -> ItemSelection:
        """Lease ``num_samples`` items (their mirror rows in ``mirror_rows``)."""
        return self.accept(self.session.select(num_samples, None, timeout))

    def select_async(self, num_samples: int, release: list[int] | None = None) -> PendingSelect:
        """Send a Select (ending ``release`` leases first) without waiting; ``accept`` its result's selection."""
        return self.session.select_async(num_samples, None, None, list(release or ()))

    def accept(self, selection: ItemSelection) -> ItemSelection:
        """Follow the layout a Select answer brings (call it on every selection before ``gather``)."""
        if selection.layout is not None:
            self._follow(selection.layout)
        if self.layout is None:
            raise RuntimeError("Select answered items before the table had a layout")
        return selection

    def gather(self, selection: ItemSelection, out: Any = None) -> Any:
        """The selected items' slot rows as one ``[n, row_bytes]`` array (CuPy on the learner's GPU, else NumPy).

        Mirrored items come from the mirror, the others from the segment. Read before ``release``.
        """
        size = row_bytes(self.layout)
        n = len(selection)
        rows = selection.mirror_rows if selection.mirror_rows is not None else np.full(n, -1, np.int64)
        hit = rows >= 0
        if not self.on_gpu:
            out = np.empty((n, size), np.uint8) if out is None else out
            segment = self._mapping.bytes[: self.layout.capacity * size].reshape(-1, size)
            out[hit] = self.mirror.rows(size)[rows[hit]]
            out[~hit] = segment[selection.slots[~hit]]
            return out
        cp = self._cp
        with cp.cuda.Device(self.device):
            out = cp.empty((n, size), cp.uint8) if out is None else out
            # Rows are moved as 8-byte words (a row is a multiple of 128 bytes): one load per word, not per byte.
            words = out.view(cp.uint64)
            mirror = self.mirror.rows(size).view(cp.uint64)
            segment = self._registration.device_array(0, self.layout.capacity * size).reshape(-1, size).view(cp.uint64)
            if hit.all():
                cp.take(mirror, cp.asarray(rows), axis=0, out=words)
            elif not hit.any():
                cp.take(segment, cp.asarray(selection.slots), axis=0, out=words)
            else:
                where = cp.asarray(np.flatnonzero(hit))
                words[where] = cp.take(mirror, cp.asarray(rows[hit]), axis=0)
                where = cp.asarray(np.flatnonzero(~hit))
                words[where] = cp.take(segment, cp.asarray(selection.slots[~hit]), axis=0)
            return out

    def segment_rows(self, slots: np.ndarray) -> Any:
        """The slots' rows as the segment holds them (a CuPy view-and-take over the registered mapping on a
        GPU, else NumPy): the host path alone, e.g. to check a gathered batch against it."""
        size = row_bytes(self.layout)
        if not self.on_gpu:
            return self._mapping.bytes[: self.layout.capacity * size].reshape(-1, size)[np.asarray(slots)]
        cp = self._cp
        with cp.cuda.Device(self.device):
            segment = self._registration.device_array(0, self.layout.capacity * size).reshape(-1, size)
            return cp.take(segment, cp.asarray(np.asarray(slots)), axis=0)

    def release(self, selection: ItemSelection) -> bool:
        """End the selection's lease; True when it was still good (its bytes intact), False when stale."""
        return selection.lease_id not in self.session.release([selection.lease_id])

    def close(self) -> None:
        """Close the session, the mirror and the segment mapping. Idempotent."""
        self.session.close()
        if self.on_gpu:
            with self._cp.cuda.Device(self.device):
                self._cp.cuda.runtime.deviceSynchronize()
        self._drop_segment()
        self.mirror.close()

    def __enter__(self) -> DeviceTierReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
