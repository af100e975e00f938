"""A learner's data-plane session on the control plane: Select and Release.

``Select`` returns item references (slot, generation, lengths) with their
SampleInfo and leases the slots; the learner moves the bytes over its plane and
then releases the lease. The daemon reports a lease stale when it expired or a
slot was rewritten meanwhile: the batch read under it is discarded.

On the daemon's host both calls take the daemon's local lane
(gear_client/connection/lane_client.py) when the session's daemon channel offers one: the
same request and answer messages, the same statuses, at about half gRPC's round
trip and a fifth of its client CPU. A call the lane cannot carry (``LaneBroken``)
is sent again over gRPC; ``GEAR_LOCAL_LANE=0`` keeps every call on gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gear_client.connection.lane_client import LaneBroken, LaneFuture
from gear_contract._proto import replay_pb2 as pb
from gear_contract.lane_frames import RELEASE, SELECT
from gear_contract.layout import TableLayout


def wait_ms(timeout: float | None) -> int:
    """A call's ``timeout_ms`` from seconds: 0 (wait forever) for None; at least 1 otherwise, so that a
    timeout of 0 (Reverb's "do not wait") fails at once instead of waiting forever."""
    if timeout is None:
        return 0
    return max(1, int(timeout * 1000))

@dataclass
class ItemSelection:
    """A Select answer as arrays."""

    slots: np.ndarray  # int64 [n]
    generations: np.ndarray  # uint64 [n]
    lengths: np.ndarray  # int64 [n, C]
    infos: tuple[np.ndarray, ...]  # keys, probabilities, table_sizes, priorities, times_sampled
    lease_id: int
    layout_version: int
    layout: TableLayout | None = None  # sent when the table's layout changed since the session last saw it
    region: pb.RdmaRegion | pb.NixlRegion | None = None  # rdma, nixl: that layout's registered segment
    mirror_rows: np.ndarray | None = None  # device: each item's GPU-mirror row (-1: read from the segment)

    def __len__(self) -> int:
        return len(self.slots)


def _array(tensor: pb.Tensor, dtype: str) -> np.ndarray:
    arr = np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype)).reshape(tuple(tensor.shape))
    if arr.dtype != np.dtype(dtype):
        raise ValueError(f"Select answered {tensor.dtype} where {dtype} was expected")
    return arr


def parse_select(response: pb.SelectResponse, num_columns: int | None) -> ItemSelection:
    """Arrays of a SelectResponse, packed or per item (``num_columns`` None: from the answer itself)."""
    from gear_client.data_planes.batch import info_arrays

    layout = TableLayout.from_proto(response.layout) if response.HasField("layout") else None
    region = response.region if response.HasField("region") else None
    if response.HasField("nixl"):
        region = response.nixl
    if response.HasField("slots"):  # packed
        slots = _array(response.slots, "<i8")
        lengths = _array(response.lengths, "<i4").astype(np.int64)
        if lengths.shape[0] != len(slots) or (layout is not None and lengths.shape[1] != len(layout.columns)):
            raise ValueError("Select answered lengths that do not match its items")
        # the learner's own arrays (writable, as NumPy and PyTorch expect), not views of the message
        infos = (_array(response.keys, "<u8").copy(), _array(response.probabilities, "<f8").copy(),
                 _array(response.table_sizes, "<i8").copy(), _array(response.priorities, "<f8").copy(),
                 _array(response.times_sampled, "<i4").copy())
        rows = _array(response.mirror_rows, "<i8") if response.HasField("mirror_rows") else None
        if rows is not None and len(rows) != len(slots):
            raise ValueError(f"Select answered {len(rows)} mirror rows for {len(slots)} items")
        return ItemSelection(slots, _array(response.generations, "<u8"), lengths, infos, int(response.lease_id),
                             int(response.layout_version), layout, region, rows)
    refs = response.refs
    n = len(refs)
    if response.HasField("layout"):
        num_columns = len(response.layout.columns)
    elif num_columns is None:
        num_columns = len(refs[0].lengths) if n else 0
    slots = np.fromiter((r.slot for r in refs), np.int64, n)
    generations = np.fromiter((r.generation for r in refs), np.uint64, n)
    flat = [x for r in refs for x in r.lengths]
    if len(flat) != n * num_columns:
        raise ValueError(f"Select answered {len(flat)} lengths for {n} items of {num_columns} columns")
    lengths = np.asarray(flat, dtype=np.int64).reshape(n, num_columns)
    return ItemSelection(slots, generations, lengths, info_arrays(response.info), int(response.lease_id),
                         int(response.layout_version), layout, region)


class GroupSlice(NamedTuple):
    """A group rank's part of one step: the step, its picks (0: world_size x num_samples) and where this
    rank's slice starts (with picks 0: rank x num_samples, the daemon's choice)."""

    step: int
    picks: int = 0
    offset: int = 0


class PendingSelect:
    """A Select on its way: ``result()`` waits for (selection, stale leases of those it released).

    A learner keeps a few in flight so that the daemon selects the next batches
    while the current ones are gathered; the round trip leaves the critical path.
    """

    def __init__(self, future, num_columns: int | None, released: list[int]):
        self._future = future
        self._num_columns = num_columns
        self.released = released  # the leases this Select ends (their verdicts come with its answer)
        self._answer: tuple[ItemSelection, set[int]] | None = None

    def done(self) -> bool:
        return self._answer is not None or self._future.done()

    def result(self, timeout: float | None = None) -> tuple[ItemSelection, set[int]]:
        """(selection, stale ones of ``released``); grpc.RpcError as the call ended with (or on timeout)."""
        if self._answer is None:
            response = self._future.result(timeout=timeout)
            self._answer = parse_select(response, self._num_columns), set(response.stale_lease_ids)
        return self._answer

    def cancel(self) -> bool:
        """Cancel the call; False when it had already ended (its lease then has to be released)."""
        return self._future.cancel()


class LaneCall:
    """A call sent on the local lane, as a grpc future; sent again over gRPC if the lane cannot carry it.

    ``LaneBroken`` (connection lost, daemon stopping, lane full) drops the lane
    (``on_broken``) and sends the same request over gRPC (``resend``), whose
    waiting and errors then apply. A Select the daemon ran before the lane broke
    is harmless to send again: the leases it ended come back stale from the
    second one, and its own lease expires. Other errors are the daemon's status,
    as ``grpc.RpcError``s with the RPC's codes.
    """

    def __init__(self, future: LaneFuture, resend: Callable[[], Any], on_broken: Callable[[], None]):
        self._future: Any = future
        self._resend: Callable[[], Any] | None = resend  # None once sent over gRPC (or given up)
        self._on_broken = on_broken

    def result(self, timeout: float | None = None) -> Any:
        """The response message; grpc.RpcError as the call ended; grpc.FutureTimeoutError after ``timeout``."""
        if self._resend is None:
            return self._future.result(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return self._future.result(timeout=timeout)
        except LaneBroken:
            self._fall_back()
        return self._future.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))

    def done(self) -> bool:
        if not self._future.done():
            return False
        if self._resend is not None and self._broke():
            self._fall_back()
            return self._future.done()
        return True

    def cancel(self) -> bool:
        """Cancel the call; False once it was answered (as a grpc future's ``cancel``)."""
        if self._resend is not None and self._future.done() and self._broke():
            self._resend = None  # the lane lost it and it was never sent again: nothing runs
            return True
        return self._future.cancel()

    def _broke(self) -> bool:
        """Whether the lane call (answered) ended in LaneBroken."""
        try:
            self._future.result(timeout=0)
        except LaneBroken:
            return True
        except Exception:  # noqa: BLE001 - an answer (or the daemon's error status): the lane carried it
            return False
        return False

    def _fall_back(self) -> None:
        resend, self._resend = self._resend, None
        self._on_broken()
        self._future = resend()


class PlaneSession:
    """The control-plane half of a shm or rdma session (Select and Release over the local lane when offered)."""

    def __init__(self, stub, table: str, response: pb.OpenDataPlaneResponse, *, metadata=None, daemon=None):
        self._stub = stub
        self._daemon = daemon  # gear_client.connection.channel.DaemonChannel: its local lane, when it offers one
        self.table = table
        self.session_id = response.session_id
        self.kind = response.kind
        self.lease_timeout_s = response.lease_timeout_ms / 1000.0
        self._metadata = metadata
        self.closed = False

    def select(self, num_samples: int, num_columns: int | None, timeout: float | None,
               release: list[int] | None = None, step: GroupSlice | None = None) -> ItemSelection:
        """Select (packed) and lease ``num_samples`` items; ``release``: leases to end first; ``step``: a
        group rank's slice of a step (sessions opened with a SelectionGroup)."""
        return self.select_and_release(num_samples, num_columns, timeout, release or [], step)[0]

    def select_and_release(self, num_samples: int, num_columns: int | None, timeout: float | None,
                           release: list[int], step: GroupSlice | None = None) -> tuple[ItemSelection, set[int]]:
        """One Select that also ends ``release`` leases; returns (selection, the stale ones of those)."""
        response = self._call(SELECT, self._select_request(num_samples, timeout, release, step), pb.SelectResponse,
                              self._stub.Select)
        return parse_select(response, num_columns), set(response.stale_lease_ids)

    def select_async(self, num_samples: int, num_columns: int | None, timeout: float | None,
                     release: list[int], step: GroupSlice | None = None) -> PendingSelect:
        """Send a Select (which also ends ``release`` leases) without waiting for its answer."""
        request = self._select_request(num_samples, timeout, release, step)
        future = self._on_lane(SELECT, request, pb.SelectResponse, self._stub.Select)
        if future is None:
            future = self._stub.Select.future(request, metadata=self._metadata)
        return PendingSelect(future, num_columns, release)

    def _select_request(self, num_samples: int, timeout: float | None, release: list[int],
                        step: GroupSlice | None = None) -> pb.SelectRequest:
        request = pb.SelectRequest(session_id=self.session_id, num_samples=int(num_samples), packed=True,
                                   timeout_ms=wait_ms(timeout), release_lease_ids=release)
        if step is not None:
            request.group_step, request.group_picks, request.group_offset = step.step, step.picks, step.offset
        return request

    def release(self, lease_ids: list[int]) -> set[int]:
        """End leases; returns the stale ones."""
        response = self._call(RELEASE, pb.ReleaseRequest(session_id=self.session_id, lease_ids=lease_ids),
                              pb.ReleaseResponse, self._stub.Release)
        return set(response.stale_lease_ids)

    def _call(self, kind: int, request: Any, response_type: Any, rpc: Any) -> Any:
        """``rpc``'s answer to ``request``: over the local lane when there is one, else over gRPC."""
        call = self._on_lane(kind, request, response_type, rpc)
        return call.result() if call is not None else rpc(request, metadata=self._metadata)

    def _on_lane(self, kind: int, request: Any, response_type: Any, rpc: Any) -> LaneCall | None:
        """``request`` sent on the daemon's local lane; None when there is none (the caller uses gRPC)."""
        daemon = self._daemon
        lane = daemon.local_lane() if daemon is not None else None
        if lane is None:
            return None
        try:
            future = lane.future(kind, request, response_type)
        except LaneBroken:
            daemon.lane_broken(lane)
            return None
        return LaneCall(future, lambda: rpc.future(request, metadata=self._metadata),
                        lambda: daemon.lane_broken(lane))

    def close(self) -> None:
        """End the session (over gRPC); the daemon ends a Select of it still waiting, on either path."""
        if self.closed:
            return
        self.closed = True
        try:
            self._stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=self.session_id), metadata=self._metadata,
                                      timeout=5)
        except Exception:  # noqa: BLE001 - the daemon reaps the session anyway
            pass
