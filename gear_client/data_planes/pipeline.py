"""A pipelined learner's work in flight: how wide and deep it runs, its queues, and draining it.

``PlaneSampler.batches`` sends Selects ahead while earlier answers are
gathered; ``PipelineState`` holds what is in flight (Selects sent, gathers
running, leases waiting for their verdict, ready batches), ``select_width`` and
``gathers_in_flight`` size it, ``LayoutStep`` says what to do with an answer
after following the table's layout, and ``drain`` ends it with every lease
released once.
"""

from __future__ import annotations

import enum
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from gear_client.data_planes.batch import Pending, SampledBatch
from gear_client.data_planes.session import PendingSelect, PlaneSession

# Pipelined batches(): gathers running before the oldest is waited for, and Selects sent ahead.
PIPELINE_DEPTH = 3
PIPELINE_PREFETCH = 2
# Items one pipelined Select asks for at most when it asks for several batches (batches_per_select
# None): enough that a batch of 32 items is not bound by the Select round trip (4 batches per round
# trip and two Selects in flight), few enough that the slots leased at once stay well inside a
# table's spare slots and one gather's buffer stays small (256 items of 256 KiB per Select gather
# more slowly on a host than 128).
ITEMS_PER_SELECT = 128
# Into GPU memory the gather runs at the PCIe ceiling, so the Select round trip is what a batch
# waits for; and under insert load every Select costs the daemon's one interpreter. A GPU learner
# asks for more batches per Select (B=256: 4), bounded in bytes so that one gather's device buffer
# stays moderate. Beside inserting actors, one batch per Select leaves a B=256 GPU learner at about
# half its solo rate; four batches per Select keep it at its solo rate (`make bench-scale-gpu`).
GPU_ITEMS_PER_SELECT = 1024
GPU_BYTES_PER_SELECT = 512 << 20
MAX_BATCHES_PER_SELECT = 8
MAX_SELECT_ITEMS = 1 << 20  # the daemon's cap on one Select
DRAIN_WAIT_S = 1.0  # how long closing a pipeline waits for its Selects in flight before cancelling them


class LayoutStep(enum.Enum):
    """What the pipeline does with a Select answer after following the table's layout."""

    GATHER = "gather"  # the plane reads the segment the answer addresses
    DROP = "drop"  # release it unread (selected before a growth, or its segment is gone)
    RECOVER = "recover"  # leave the pipeline: sample()'s recovery re-opens


def select_width(batch_size: int, asked: int | None = None, *, gpu: bool = False, item_bytes: int = 0) -> int:
    """Batches one pipelined Select asks for: ``asked``, or as many as fit ITEMS_PER_SELECT (at most 8);
    gathering into GPU memory, as many as fit GPU_ITEMS_PER_SELECT and GPU_BYTES_PER_SELECT (``item_bytes``:
    one item's bytes in the segment, 0 when not known yet)."""
    if asked is not None:
        if asked < 1:
            raise ValueError(f"batches_per_select must be >= 1, got {asked}")
        return max(1, min(int(asked), MAX_SELECT_ITEMS // batch_size))
    if gpu:
        items = GPU_ITEMS_PER_SELECT
        if item_bytes > 0:
            items = min(items, GPU_BYTES_PER_SELECT // item_bytes)
        return max(1, min(MAX_BATCHES_PER_SELECT, items // batch_size))
    return max(1, min(MAX_BATCHES_PER_SELECT, ITEMS_PER_SELECT // batch_size))


def gathers_in_flight(depth: int, per_select: int) -> int:
    """Gathers a pipeline keeps running for ``depth`` batches when each gather reads ``per_select`` of them.

    One batch per Select: ``depth`` gathers. Several: enough gathers for
    ``depth`` batches, but two at least, so that the next gather is queued (on a
    GPU stream) while the learner takes the batches of the previous one.
    """
    depth = max(1, int(depth))
    if per_select <= 1:
        return depth
    return max(2, -(-depth // per_select))


@dataclass
class PipelineState:
    """A pipeline's work in flight, oldest first (see PlaneSampler._pipeline).

    ``selects``: Selects sent; ``gathering``: (lease, gather) per Select answer
    being gathered (one gather reads all the batches a Select asked for);
    ``verdicts``: per gathered lease, its items, waiting for the verdict of the
    Select that ends the lease; ``to_release``: leases the next Select ends;
    ``ready``: batches of ``batch_size`` items whose lease came back intact.
    """

    batch_size: int
    selects: deque[PendingSelect] = field(default_factory=deque)
    gathering: deque[tuple[int, Pending]] = field(default_factory=deque)
    verdicts: dict[int, SampledBatch] = field(default_factory=dict)
    to_release: list[int] = field(default_factory=list)
    ready: deque[SampledBatch] = field(default_factory=deque)

    def finish_oldest(self) -> None:
        """Wait for the oldest gather; its lease may go once it ended (a failed one too)."""
        lease, gather = self.gathering.popleft()
        try:
            self.verdicts[lease] = gather.wait()
        finally:
            self.to_release.append(lease)

    def finish_all(self) -> None:
        while self.gathering:
            self.finish_oldest()

    def judge(self, released: list[int], stale: set[int]) -> int:
        """Take the verdicts on ``released`` leases: intact items become ready batches; returns the batches dropped."""
        dropped = 0
        for lease in released:
            items = self.verdicts.pop(lease, None)
            if items is None:
                continue  # a selection dropped without gathering
            batches = items.split(self.batch_size)
            if lease in stale:
                dropped += len(batches)
            else:
                self.ready.extend(batches)
        return dropped


def drain(session: PlaneSession, state: PipelineState) -> None:
    """End a pipeline: wait for its gathers, collect or cancel its Selects, release every lease once."""
    if sys.is_finalizing():
        return  # a generator dropped at exit: its sampler was closed at exit already (sampler.py)
    while state.gathering:
        try:
            state.finish_oldest()  # never release a lease while its bytes are still being read
        except Exception:  # noqa: BLE001 - draining goes on: every lease is released
            pass
    leases = dict.fromkeys([*state.verdicts, *state.to_release])
    deadline = time.monotonic() + DRAIN_WAIT_S
    for pending in state.selects:
        leases.update(dict.fromkeys(pending.released))  # their Select may never reach the daemon
        try:
            try:
                selection, _ = pending.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                if pending.cancel():
                    continue  # the daemon ends a cancelled Select (and releases what it selected)
                selection, _ = pending.result()
            leases[selection.lease_id] = None
        except (grpc.RpcError, grpc.FutureCancelledError):
            pass
    if leases and not session.closed:
        try:
            session.release(list(leases))
        except grpc.RpcError:
            pass
