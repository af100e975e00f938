"""The seam between ``PlaneSampler`` and the data planes: what each plane does, typed.

Every plane (inline, shm, rdma) is a ``Plane``: it has a kind, can end a call
blocked in another thread and can be closed. Two kinds of plane differ in who
selects the items:

* ``ReadingPlane`` (shm, rdma): the sampler's ``Select`` leases items; the plane
  reads the leased items' bytes by reference (``start`` begins a gather and
  returns at once where it can, ``fetch`` waits for it) and follows the table's
  layout when it changes;
* ``SamplingPlane`` (inline): one Sample RPC selects the items and carries their
  bytes; the plane pads them into a batch.

The sampler holds either kind in its own typed field and talks to planes only
through these protocols.
"""

from __future__ import annotations

from typing import Protocol

from gear_client.data_planes.batch import Pending, SampledBatch
from gear_client.data_planes.range_planning import WindowSpec
from gear_client.data_planes.session import ItemSelection
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout


class PlaneInterrupted(Exception):
    """A plane lost what it reads through but may come back as it is (a broken connection, a layout the
    daemon no longer serves): the sampler negotiates again without excluding this plane."""


class Plane(Protocol):
    """What every data plane does."""

    kind: str  # "shm", "rdma", "nixl", "stream" or "inline"
    layout: TableLayout | None  # the layout batches are padded by (None before the table has one)
    bytes_moved: int  # item bytes moved so far: read from the segment (shm, rdma), received (inline)

    def cancel(self) -> None:
        """End a call this plane blocks on in another thread (close() follows)."""

    def close(self) -> None:
        """Free what the plane holds (mappings, registered buffers, pools)."""


class ReadingPlane(Plane, Protocol):
    """A plane that reads the items a Select leased (shm, rdma, nixl, stream)."""

    def set_layout(self, layout: TableLayout, region: pb.RdmaRegion | pb.NixlRegion | None) -> None:
        """Read ``layout``'s segment from now on (``region``: its registration, rdma and nixl; FileNotFoundError:
        it is already unlinked)."""

    def start(self, selection: ItemSelection, window: WindowSpec) -> Pending:
        """Begin gathering ``selection``; the lease may be released only after ``wait()``."""

    def fetch(self, selection: ItemSelection, window: WindowSpec) -> SampledBatch:
        """Gather ``selection`` and wait for it."""

    def pipelined(self) -> None:
        """Several gathers will be in flight from now on (a plane may move its work off the caller's thread)."""


class SamplingPlane(Plane, Protocol):
    """A plane whose own call selects the items and carries their bytes (inline)."""

    def sample(self, num_samples: int, *, window: WindowSpec = None, timeout: float | None = None) -> SampledBatch:
        """``num_samples`` items padded per ``window`` (fewer only when ``timeout`` passes after some)."""
