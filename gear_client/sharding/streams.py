"""Read-ahead over shards: each shard's picks streamed in the background, batches cut from the streams.

For tables whose sampling takes nothing (the datasets read those ahead), every
live shard runs its own ``PlaneSampler.batches`` pipeline (Selects sent ahead,
several batches per Select, releases riding on later Selects, its best plane)
in a thread, filling a short queue with chunks of independent picks. A batch
then takes from each shard as many items as a multinomial split by the shards'
latest sizes (uniform) or priority masses (prioritized) says, in stream order.

Picks drawn independently on each shard and counted by the split are the picks
the one-batch-at-a-time path makes; the sizes and masses are those the chunks
were selected with (derived from their answers, as ``selection.globalise``
does), so reported probabilities stay p^a / global mass of that moment, with
the read-ahead lag a single daemon's pipeline has too. No round trip is left on
the learner's path: a batch costs the split and one copy into the assembled
buffer.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from gear_client import errors
from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.range_planning import WindowSpec
from gear_client.data_planes.sampler import PlaneSampler, SamplerClosedError
from gear_client.sharding.assembly import rows
from gear_client.sharding.membership import Shard
from gear_client.sharding.selection import PRIORITIZED, Policy, ShardWeight, selection_mass

STREAM_DEPTH = 2  # chunks a shard keeps ready
STREAM_CHUNK_BYTES = 64 << 20  # a chunk (one Select's picks) holds at most this many bytes of items ...
# ... and at least ``least`` items (a whole batch): small items are selected many batches' worth at a time
_POLL_S = 0.5


@dataclass
class StreamFailed:
    """What ended a shard's stream (put in its queue)."""

    error: BaseException


class ShardStream:
    """One shard's picks, read ahead by its own PlaneSampler in a thread (see module docstring)."""

    def __init__(self, shard: Shard, sampler: PlaneSampler, policy: Policy, chunk: int, window: WindowSpec,
                 weight: ShardWeight | None, most: int):
        """``chunk``: the fewest items a Select picks; ``most``: the most (within STREAM_CHUNK_BYTES)."""
        self.shard = shard
        self.sampler = sampler
        self.policy = policy
        self.weight = weight  # the latest size / mass: from the last chunk taken, else from ServerInfo
        self.learned_at = time.monotonic()  # when ``weight`` was set
        self._chunk = int(chunk)
        self._most = max(self._chunk, int(most))
        self._window = window
        self._queue: queue.Queue[SampledBatch | StreamFailed] = queue.Queue(maxsize=STREAM_DEPTH)
        self._stop = threading.Event()
        self._leftover: SampledBatch | None = None  # the chunk being taken from, from row ``_offset``
        self._offset = 0
        self._thread = threading.Thread(target=self._run, name=f"gear-shard-stream-{shard.index}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            chunk = chunk_items(self._chunk, self._most, self.sampler.item_bytes())
            while not self._stop.is_set():
                try:
                    for batch in self.sampler.batches(chunk, window=self._window):
                        if not self._put(batch):
                            return
                except errors.DeadlineExceededError:
                    continue  # a rate limiter held it past a timeout: read on
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            if not self._stop.is_set():
                self._put(StreamFailed(exc))

    def _put(self, item: SampledBatch | StreamFailed) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def take(self, n: int, wait_s: float) -> tuple[list[SampledBatch], int]:
        """Up to ``n`` items in stream order, waiting at most ``wait_s`` for a chunk; (pieces, still missing).

        Raises ``StreamError`` when the stream ended (its error as the cause).
        """
        pieces: list[SampledBatch] = []
        while n > 0:
            chunk, offset = self._leftover, self._offset
            self._leftover, self._offset = None, 0
            if chunk is None:
                try:
                    item = self._queue.get(timeout=wait_s)
                except queue.Empty:
                    break
                if isinstance(item, StreamFailed):
                    self._queue.put_nowait(item)  # every later take sees it too
                    raise StreamError(str(item.error)) from item.error
                chunk = item
                self._learn(chunk)
            k = min(n, len(chunk) - offset)
            pieces.append(rows(chunk, offset, offset + k))  # one view per piece: the rest stays the chunk's
            if offset + k < len(chunk):
                self._leftover, self._offset = chunk, offset + k
            n -= k
        return pieces, n

    def _learn(self, chunk: SampledBatch) -> None:
        """The shard's size and mass when it selected this chunk."""
        if not len(chunk):
            return
        mass = 0.0
        if self.policy.kind == PRIORITIZED:
            derived = selection_mass(self.policy, chunk.priorities, chunk.probabilities)
            mass = derived if derived is not None else 0.0
        self.weight = ShardWeight(self.shard.index, int(chunk.table_sizes[0]), mass)
        self.learned_at = time.monotonic()

    def reported(self, weight: ShardWeight, since: float) -> None:
        """The shard's ServerInfo answer: taken unless a chunk told more recently (a shard rarely
        drawn, or still empty, must not keep an old mass and starve)."""
        if self.learned_at < since:
            self.weight = weight
            self.learned_at = since

    def close(self) -> None:
        self._stop.set()
        self.sampler.close()
        self._thread.join(0.1)  # a thread still in a call to a hung daemon ends with it


def chunk_items(least: int, most: int, item_bytes: int) -> int:
    """Items a stream's Select picks: up to ``most`` within STREAM_CHUNK_BYTES, never under ``least``.

    ``least`` when the items' size is not known (inline). Every Select costs both sides a fixed part (the
    round trip, the answer's framing, the calls around it), so a Select picking several batches' worth
    (16384 keys for batches of 4096 over 4 shards) makes a batch about twice as cheap as one per batch.
    """
    if item_bytes <= 0:
        return least
    return max(least, min(most, STREAM_CHUNK_BYTES // item_bytes))


class StreamError(RuntimeError):
    """A shard's stream ended with an error (the cause)."""


def closed_error(exc: BaseException) -> bool:
    """Whether a stream's error only says its sampler was closed (the consumer closed it)."""
    return isinstance(exc, SamplerClosedError) or isinstance(exc.__cause__, SamplerClosedError)
