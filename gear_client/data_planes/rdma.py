"""The rdma plane: a learner on another host reads the selected items with one-sided RDMA READs.

Flow for one batch: ``Select`` (control plane) -> plan the byte ranges
(range_planning: coalesce, split, spread over queue pairs, chain with selective
signalling) -> post the chains and poll completions (``execute_plan``) into a
registered receive buffer laid out as the batch -> zero the padding ->
``Release`` (a stale lease discards the batch). The daemon's CPU never touches
the bytes.

``execute_plan`` drives any transport with ``post_reads`` and ``poll`` (the
verbs queue pairs here; an in-memory transport in the tests), so the scheduling
is tested without hardware. ``VerbsConnection`` is the learner's verbs side.
"""

from __future__ import annotations

import mmap
import time
from collections import deque
from typing import Protocol

import numpy as np

from gear_client.data_planes.batch import BufferPool, Pending, SampledBatch, column_arrays
from gear_client.data_planes.projection import ColumnChoice, narrowed
from gear_client.data_planes.range_planning import (
    LENGTH,
    REMOTE,
    BatchLayout,
    ReadPlan,
    WindowSpec,
    padding_ranges,
    plan_ranges,
    plan_reads,
    resolve_windows,
    window_bounds,
    window_steps,
)
from gear_client.data_planes.session import ItemSelection, PlaneSession
from gear_contract import addressing
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout

DEFAULT_NUM_QPS = 4
DEFAULT_CHAIN_LENGTH = 16  # READs per signalled chain
DEFAULT_MAX_SEND_WR = 256  # send-queue depth per QP
BALANCE_CHUNK = 1 << 20  # ranges over 1 MiB are cut so queue pairs carry even loads
READ_TIMEOUT_S = 30.0


class RdmaReadError(RuntimeError):
    """An RDMA READ failed (bad completion status, or no completion in time)."""


class ReadTransport(Protocol):
    """What ``execute_plan`` needs: post a chain on a queue pair, poll the shared completion queue."""

    def post_reads(self, queue: int, wr_id: int, ranges: np.ndarray, local, remote: pb.RdmaRegion) -> None: ...

    def poll(self, max_entries: int = 32) -> list: ...


def execute_plan(transport: ReadTransport, plan: ReadPlan, local, remote: pb.RdmaRegion, *,
                 max_in_flight: int, timeout_s: float = READ_TIMEOUT_S, clock=time.monotonic) -> int:
    """Post every chain of ``plan``, at most ``max_in_flight`` chains per queue pair, until all complete.

    A completion of chain k on a queue pair frees its send-queue slots (and, RC
    being in order, those of every earlier chain there), so the next chain of that
    queue pair is posted. Raises RdmaReadError on an error completion or when no
    progress is seen for ``timeout_s``. Returns the number of chains completed.
    """
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    pending = [deque(chains) for chains in plan.chains]
    in_flight = [0] * len(pending)
    owner: dict[int, int] = {}
    total = sum(len(p) for p in pending)
    done = 0

    def post_more(q: int) -> None:
        while pending[q] and in_flight[q] < max_in_flight:
            chain = pending[q].popleft()
            transport.post_reads(q, chain.wr_id, chain.ranges, local, remote)
            owner[chain.wr_id] = q
            in_flight[q] += 1

    for q in range(len(pending)):
        post_more(q)
    last_progress = clock()
    while done < total:
        completions = transport.poll(32)
        if not completions:
            if clock() - last_progress > timeout_s:
                raise RdmaReadError(f"RDMA READs stalled: {total - done} of {total} chains not completed "
                                    f"after {timeout_s:.1f} s")
            continue
        last_progress = clock()
        for wc in completions:
            if not wc.ok:
                raise RdmaReadError(f"RDMA READ chain {wc.wr_id} failed with completion status {wc.status}")
            q = owner.pop(wc.wr_id, None)
            if q is None:
                raise RdmaReadError(f"completion for unknown work request {wc.wr_id}")
            in_flight[q] -= 1
            done += 1
            post_more(q)
    return done


class VerbsConnection:
    """The learner's verbs resources: device, queue pairs, registered receive buffers."""

    def __init__(self, port: addressing.PortInfo, *, num_qps: int = DEFAULT_NUM_QPS,
                 max_send_wr: int = DEFAULT_MAX_SEND_WR):
        from gear_contract import rdma_verbs as verbs

        self.port = port
        self.device = verbs.Device(port, responder=False)
        try:
            self.queue_pairs = verbs.QueuePairs(self.device, num_qps, max_send_wr=max_send_wr)
        except BaseException:
            self.device.close()
            raise
        self.num_qps = num_qps
        self.max_send_wr = max_send_wr
        self.max_message = port.max_msg_size or (1 << 30)
        self.rd_atomic = 1
        self._regions: dict[int, tuple[mmap.mmap, object]] = {}

    def endpoint(self) -> pb.RdmaEndpoint:
        return self.queue_pairs.endpoint()

    def connect(self, remote: pb.RdmaEndpoint) -> None:
        addressing.validate_endpoint(remote, expected_qps=self.num_qps)
        av = addressing.address_vector(self.port, remote)
        self.rd_atomic = addressing.rd_atomic(self.port, remote)
        self.max_message = addressing.max_message(self.port, remote)
        self.queue_pairs.connect(remote, av, addressing.path_mtu(self.port, remote), self.rd_atomic)

    def allocate(self, nbytes: int) -> np.ndarray:
        """A page-aligned receive buffer registered with the device (until ``free`` or close)."""
        mapping = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        buf = np.frombuffer(mapping, dtype=np.uint8)
        region = self.device.register(int(buf.ctypes.data), len(buf))
        self._regions[int(buf.ctypes.data)] = (mapping, region)
        return buf

    def region_of(self, buf: np.ndarray):
        return self._regions[int(buf.ctypes.data)][1]

    def free(self, buf: np.ndarray) -> None:
        """Deregister a receive buffer no READ targets any more; its memory lives on while a batch views it."""
        _, region = self._regions.pop(int(buf.ctypes.data), (None, None))
        if region is not None:
            self.device.deregister(region)

    def post_reads(self, queue: int, wr_id: int, ranges: np.ndarray, local, remote: pb.RdmaRegion) -> None:
        self.queue_pairs.post_reads(queue, wr_id, ranges, local, remote)

    def poll(self, max_entries: int = 32) -> list:
        return self.queue_pairs.poll(max_entries)

    def close(self) -> None:
        self.queue_pairs.close()
        self.device.close()  # deregisters the receive buffers
        self._regions.clear()


class RdmaPlane:
    """Batches over RDMA READs (see module docstring). ``connection`` is a VerbsConnection or a test transport."""

    kind = "rdma"

    def __init__(self, session: PlaneSession, layout: TableLayout | None, region: pb.RdmaRegion | None, connection, *,
                 chain_length: int = DEFAULT_CHAIN_LENGTH, balance_chunk: int | None = BALANCE_CHUNK,
                 timeout_s: float = READ_TIMEOUT_S, columns: ColumnChoice | None = None):
        self.session = session
        self.layout = layout
        self.columns = columns  # read only these columns' windows (None: all)
        self.bytes_moved = 0  # bytes READ from the daemon's segment
        self.region = region
        self.connection = connection
        self.chain_length = max(1, min(chain_length, connection.max_send_wr))
        self.max_in_flight = max(1, connection.max_send_wr // self.chain_length)
        self.balance_chunk = balance_chunk
        self.timeout_s = timeout_s
        # Reads into a buffer end within fetch(): one the pool forgets can be deregistered at once.
        self._pool = BufferPool(allocate=connection.allocate, forget=getattr(connection, "free", None))
        self.last_plan: ReadPlan | None = None

    def set_layout(self, layout: TableLayout, region: pb.RdmaRegion | None) -> None:
        """The table's layout changed: read the new segment's region from now on."""
        if region is None:
            raise RdmaReadError("the daemon sent a new layout without its RDMA region")
        self.layout, self.region = layout, region

    def start(self, selection: ItemSelection, window: WindowSpec) -> Pending:
        """The reads complete before this returns (the CPU polls completions); the batch is ready."""
        return Pending(None, self.fetch(selection, window))

    def pipelined(self) -> None:
        """Nothing changes: the reads of a batch complete within start() (the CPU polls completions)."""

    def cancel(self) -> None:
        """Nothing to end: READs in flight complete or time out within fetch()."""

    def fetch(self, selection: ItemSelection, window: WindowSpec) -> SampledBatch:
        layout, lengths = narrowed(self.columns, self.layout, selection.lengths)
        n = len(selection)
        windows = resolve_windows(layout, window)
        batch = BatchLayout.build(layout, n, window_steps(windows))
        starts, counts, firsts = window_bounds(lengths, layout, windows)
        ranges = plan_ranges(layout, selection.slots, starts, counts, batch, firsts)
        if len(ranges) and int((ranges[:, REMOTE] + ranges[:, LENGTH]).max()) > self.region.length:
            raise RdmaReadError("a selected range lies outside the daemon's registered segment")
        plan = plan_reads(ranges, num_queues=self.connection.num_qps, max_message=self.connection.max_message,
                          chain_length=self.chain_length, balance_chunk=self.balance_chunk)
        buf = self._pool.get(batch.nbytes)
        execute_plan(self.connection, plan, self.connection.region_of(buf), self.region,
                     max_in_flight=self.max_in_flight, timeout_s=self.timeout_s)
        for off, length in padding_ranges(counts, batch, firsts).tolist():
            buf[off:off + length] = 0
        self.last_plan = plan
        self.bytes_moved += int(ranges[:, LENGTH].sum()) if len(ranges) else 0
        keys, probs, sizes, prios, times = selection.infos
        return SampledBatch(keys, probs, sizes, prios, times, column_arrays(buf, layout, batch, n),
                            counts.astype(np.int32), layout.structure, tuple(c.squeeze for c in layout.columns),
                            plane=self.kind)

    def close(self) -> None:
        self._pool.clear()
        self.connection.close()
