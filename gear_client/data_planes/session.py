"""A learner's data-plane session on the control plane: Select and Release.

``Select`` returns item references (slot, generation, lengths) with their
SampleInfo and leases the slots; the learner moves the bytes over its plane and
then releases the lease. The daemon reports a lease stale when it expired or a
slot was rewritten meanwhile: the batch read under it is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout


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
    region: pb.RdmaRegion | None = None  # rdma: that layout's memory region

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
    if response.HasField("slots"):  # packed
        slots = _array(response.slots, "<i8")
        lengths = _array(response.lengths, "<i4").astype(np.int64)
        if lengths.shape[0] != len(slots) or (layout is not None and lengths.shape[1] != len(layout.columns)):
            raise ValueError("Select answered lengths that do not match its items")
        # the learner's own arrays (writable, as NumPy and PyTorch expect), not views of the message
        infos = (_array(response.keys, "<u8").copy(), _array(response.probabilities, "<f8").copy(),
                 _array(response.table_sizes, "<i8").copy(), _array(response.priorities, "<f8").copy(),
                 _array(response.times_sampled, "<i4").copy())
        return ItemSelection(slots, _array(response.generations, "<u8"), lengths, infos, int(response.lease_id),
                             int(response.layout_version), layout, region)
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


class PlaneSession:
    """The control-plane half of a shm or rdma session."""

    def __init__(self, stub, table: str, response: pb.OpenDataPlaneResponse, *, metadata=None):
        self._stub = stub
        self.table = table
        self.session_id = response.session_id
        self.kind = response.kind
        self.lease_timeout_s = response.lease_timeout_ms / 1000.0
        self._metadata = metadata
        self.closed = False

    def select(self, num_samples: int, num_columns: int | None, timeout: float | None,
               release: list[int] | None = None) -> ItemSelection:
        """Select (packed) and lease ``num_samples`` items; ``release``: leases to end first."""
        return self.select_and_release(num_samples, num_columns, timeout, release or [])[0]

    def select_and_release(self, num_samples: int, num_columns: int | None, timeout: float | None,
                           release: list[int]) -> tuple[ItemSelection, set[int]]:
        """One Select that also ends ``release`` leases; returns (selection, the stale ones of those)."""
        response = self._stub.Select(self._select_request(num_samples, timeout, release), metadata=self._metadata)
        return parse_select(response, num_columns), set(response.stale_lease_ids)

    def select_async(self, num_samples: int, num_columns: int | None, timeout: float | None,
                     release: list[int]) -> PendingSelect:
        """Send a Select (which also ends ``release`` leases) without waiting for its answer."""
        future = self._stub.Select.future(self._select_request(num_samples, timeout, release), metadata=self._metadata)
        return PendingSelect(future, num_columns, release)

    def _select_request(self, num_samples: int, timeout: float | None, release: list[int]) -> pb.SelectRequest:
        return pb.SelectRequest(session_id=self.session_id, num_samples=int(num_samples), packed=True,
                                timeout_ms=int(timeout * 1000) if timeout else 0, release_lease_ids=release)

    def release(self, lease_ids: list[int]) -> set[int]:
        """End leases; returns the stale ones."""
        response = self._stub.Release(pb.ReleaseRequest(session_id=self.session_id, lease_ids=lease_ids),
                                      metadata=self._metadata)
        return set(response.stale_lease_ids)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._stub.CloseDataPlane(pb.CloseDataPlaneRequest(session_id=self.session_id), metadata=self._metadata,
                                      timeout=5)
        except Exception:  # noqa: BLE001 - the daemon reaps the session anyway
            pass
