"""ShardedSampler: a learner's batches of one table spread over several daemons.

For each batch it asks every live shard for its size and selection state
(``ServerInfo``, in parallel), splits the batch (``selection.split``), has
every shard select and deliver its part over the best plane that shard offers
this learner (a ``PlaneSampler`` per shard: shm on the learner's own host,
RDMA or inline elsewhere; parts run in parallel, each with its plane's
torn-read guarantees), rewrites the reported probabilities and sizes to the
global ones and assembles one batch (``assembly``).

``batches()`` (read ahead, for the datasets) cuts uniform and prioritized
batches from every shard's stream of picks instead (``streams``).

A shard that fails (a call answered UNAVAILABLE, or one that stops answering
for ``timeout_s`` while its part is outstanding) is marked down: its part is
split again over the others, so the batch still comes out whole, and it is
left out until it answers again (``membership``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import numpy as np

from gear_client import errors
from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.range_planning import WindowSpec
from gear_client.data_planes.ranks import selection_group, torch_ranks
from gear_client.data_planes.sampler import PlaneSampler, SamplerClosedError
from gear_client.data_planes.session import GroupSlice
from gear_client.data_planes.shm import gpu_index, is_gpu_device
from gear_client.sharding.assembly import DeviceAssembly, HostAssembly, assemble, rows
from gear_client.sharding.membership import Shard, ShardSet, is_unreachable
from gear_client.sharding.selection import (
    PRIORITIZED,
    UNIFORM,
    Policy,
    ShardWeight,
    globalise,
    split,
    sum_table_infos,
)
from gear_client.sharding.streams import ShardStream, StreamError, closed_error
from gear_contract._proto import replay_pb2 as pb
from gear_contract.selectors import SPLIT_KEY, step_rng

log = logging.getLogger(__name__)

EMPTY_POLL_S = (0.005, 0.2)  # first and longest wait between looks at a table with no item on any shard
READ_AHEAD_ITEMS = 128  # batches(): items selected together (one split, one part per shard)
READ_AHEAD_GROUPS = 2  # batches(): groups fetched at once
STREAM_WEIGHTS_REFRESH_S = 1.0  # batches() over streams: how often every shard's size and mass are asked
STREAM_GROUP_BATCHES = 4  # batches() over streams: batches assembled together, at most (``group_batches``)
STREAM_GROUP_BYTES = 256 << 20  # ... and at most these bytes (B=256 of 256 KiB items: 4 batches)
STREAM_GROUP_ITEMS = 1024  # ... and, before the items' size is known (the first group), at most these items
# batches() over streams: items a shard's chunk holds at least. A chunk is a whole batch (not the shard's
# share): a batch then takes about one piece per shard (fewer pieces to assemble, fewer queue hand-offs).
STREAM_MIN_CHUNK = 8
# ... and at most this many batches' worth of the shard's share (within streams.STREAM_CHUNK_BYTES): what a
# chunk holds was picked at once, so this bounds how many batches a priority change takes to show.
STREAM_CHUNK_BATCHES = 16


@dataclass
class _Plan:
    """One batch's (or read-ahead group's) split: what each shard picks, and the draws for it."""

    policy: Policy
    weights: dict[int, ShardWeight]  # what the shards reported (the split's basis)
    counts: dict[int, int]  # shard -> items it picks
    rng: np.random.Generator  # re-splits and the row order
    deadline: float | None


class ShardedSampler:
    """Batches of ``table`` over ``shards`` with global semantics (see module docstring). Thread safe."""

    def __init__(self, shards: ShardSet, table: str, *, planes=None, device: Any = None, seed: int | None = None,
                 weights_max_age_s: float = 0.0, owns_shards: bool = False, **plane_options: Any):
        """``weights_max_age_s``: split by the shards' sizes and masses asked at most this long ago
        (0: ask before every batch, exact; more saves a round trip per batch, and the split follows
        changes of the masses that late; reported probabilities stay exact for the sampled shards).

        ``rank``/``world_size``/``group_id`` in ``plane_options`` (or an initialised torch.distributed): this
        sampler is a rank of a selection group (``sample_grouped``); ``seed`` is then the group's.
        ``from_torch`` (in ``plane_options``) False: never a rank from torch.distributed alone."""
        self.shards = shards
        self.table = table
        self.planes = planes
        self.device = device
        self._plane_options = plane_options
        self._owns_shards = owns_shards
        self._rng = np.random.default_rng(seed)
        self.group = None
        from_torch = plane_options.pop("from_torch", True)
        plane_options["from_torch"] = False  # the shards' samplers: a group only as this sampler's
        if any(plane_options.get(k) is not None for k in ("rank", "world_size", "group_id")) or (
                from_torch and torch_ranks()):
            self.group = selection_group(table, rank=plane_options.pop("rank", None),
                                         world_size=plane_options.pop("world_size", None), seed=seed,
                                         group_id=plane_options.pop("group_id", None), from_torch=from_torch)
            if self.group is not None:  # every shard's sampler joins the group on its daemon
                plane_options.update(rank=self.group.rank, world_size=self.group.world_size, seed=self.group.seed,
                                     group_id=self.group.group_id)
        self.step = 0  # a group's next step
        self._lock = threading.RLock()
        self._samplers: dict[int, PlaneSampler] = {}
        self._policy: Policy | None = None
        self._config: tuple[str, bytes] | None = None  # (shard address, table configuration) first seen
        self._config_checked: set[int] = set()  # shards whose configuration matched it (until they rejoin)
        self.weights_max_age_s = float(weights_max_age_s)
        self._weights: tuple[float, Policy, dict[int, ShardWeight]] | None = None  # (when, policy, weights)
        self.closed = False
        self.resplits = 0  # parts taken again from other shards because their shard failed
        self._streams: set[ShardStream] = set()  # batches(): the shards' read-ahead streams
        self._ended_kinds: dict[int, str] = {}  # shard -> the plane its last stream used
        self._fetcher = futures.ThreadPoolExecutor(max_workers=READ_AHEAD_GROUPS, thread_name_prefix="gear-shard-batch")
        # this consumer's assembly: on a GPU its own stream; on the CPU its reused buffers
        self._assembly = DeviceAssembly(device) if is_gpu_device(device) else HostAssembly()
        shards.on_rejoin(self._forget_sampler)

    # ----------------------------------------------------------------- per-shard samplers
    def _sampler(self, shard: Shard) -> PlaneSampler:
        with self._lock:
            if self.closed:
                raise SamplerClosedError("this sampler is closed")
            sampler = self._samplers.get(shard.index)
            if sampler is None:
                sampler = PlaneSampler(shard.client, self.table, planes=self.planes, device=self.device,
                                       **self._plane_options)
                self._samplers[shard.index] = sampler
            return sampler

    def _forget_sampler(self, shard: Shard) -> None:
        """Drop the shard's sampler; it is closed in the background (its session's CloseDataPlane waits up
        to 5 s on a daemon that stopped answering: never on the caller's path)."""
        with self._lock:
            sampler = self._samplers.pop(shard.index, None)
            self._config_checked.discard(shard.index)  # a restarted daemon may have a new configuration
        if sampler is not None:
            self.shards.submit(sampler.close)

    @property
    def kind(self) -> str | None:
        """The planes in use, joined ("shm+inline"), or None before the first batch."""
        kinds = self.kinds()
        return "+".join(sorted(set(kinds.values()))) if kinds else None

    def kinds(self) -> dict[str, str]:
        """Shard address -> the plane its part comes over."""
        with self._lock:
            samplers = dict(self._samplers)
            samplers.update({st.shard.index: st.sampler for st in self._streams})  # batches() reads through these
            kinds = dict(self._ended_kinds)
        kinds.update({i: s.kind for i, s in samplers.items() if s.kind is not None})
        return {self.shards.shards[i].address: kind for i, kind in kinds.items()}

    def open(self) -> str | None:
        """Negotiate with every live shard now (sample() does it on first use)."""
        for shard in self.shards.live():
            try:
                self._sampler(shard).open()
            except errors.ReverbError as exc:
                if is_unreachable(exc):
                    self._shard_failed(shard, exc)
                else:
                    raise
        return self.kind

    # ----------------------------------------------------------------- one batch
    def weights(self) -> tuple[Policy, dict[int, ShardWeight]]:
        """The table's policy and each live shard's size and selection state (down shards left out)."""
        live = self.shards.live()
        answers = self.shards.map(lambda s: s.server_info(self.shards.timeout_s), live)
        weights: dict[int, ShardWeight] = {}
        policy = self._policy
        missing = True
        for shard, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                if is_unreachable(answer):
                    self._shard_failed(shard, answer)
                    continue
                raise errors.from_rpc_error(answer, "sample") from answer
            for info in answer.table_info:
                if info.name == self.table:
                    missing = False
                    if shard.index not in self._config_checked:
                        self._check_config(shard, info)
                    if policy is None:
                        policy = self._policy = Policy.of(info.sampler_options, info.max_times_sampled)
                    weights[shard.index] = ShardWeight.of(shard.index, info)
                    break
        if policy is None:
            if not live or all(isinstance(a, BaseException) for a in answers):
                raise errors.ServiceError(f"sample: no shard of table '{self.table}' is reachable "
                                          f"({self._down_summary()})")
            if missing:
                raise RuntimeError(f"table '{self.table}' is not on any shard")
        return policy, weights

    def _check_config(self, shard: Shard, info: pb.TableInfo) -> None:
        """ValueError when the shard's table is configured otherwise (sampler, max_times_sampled, signature)
        than the first shard's seen: one table's semantics need every daemon's table alike."""
        config = pb.TableInfo(sampler_options=info.sampler_options, max_times_sampled=info.max_times_sampled,
                              signature=info.signature if info.HasField("signature") else None
                              ).SerializeToString(deterministic=True)
        with self._lock:
            if self._config is None:
                self._config = (shard.address, config)
            elif self._config[1] != config:
                raise ValueError(f"table '{self.table}' is configured differently on shard {shard.address} than "
                                 f"on {self._config[0]} (sampler, max_times_sampled or signature); configure "
                                 f"every daemon's table alike")
            self._config_checked.add(shard.index)

    def table_info(self) -> pb.TableInfo:
        """The table's global TableInfo (sizes and counters summed over the live shards)."""
        live = self.shards.live()
        answers = self.shards.map(lambda s: s.server_info(self.shards.timeout_s), live)
        infos = []
        for shard, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                if not is_unreachable(answer):
                    raise errors.from_rpc_error(answer, "server_info") from answer
                self._shard_failed(shard, answer)
                continue
            infos.extend(info for info in answer.table_info if info.name == self.table)
        if not infos:
            raise KeyError(f"no live shard has a table '{self.table}' ({self._down_summary()})")
        return sum_table_infos(infos)

    def _recent_weights(self) -> tuple[Policy, dict[int, ShardWeight]]:
        cached = self._weights
        now = time.monotonic()
        if cached is not None and now - cached[0] <= self.weights_max_age_s:
            live = {s.index for s in self.shards.live()}
            return cached[1], {i: w for i, w in cached[2].items() if i in live}
        policy, weights = self.weights()
        if self.weights_max_age_s > 0:
            self._weights = (now, policy, weights)
        return policy, dict(weights)

    def sample(self, num_samples: int, *, window: WindowSpec = None, timeout: float | None = None) -> SampledBatch:
        """``num_samples`` items with global semantics (fewer only when ``timeout`` passes after some were picked)."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if self.group is not None:
            return self.sample_grouped(num_samples, window=window, timeout=timeout)
        return self._fetch(self._plan(num_samples, timeout), window)

    def sample_grouped(self, num_samples: int, *, window: WindowSpec = None,
                       timeout: float | None = None) -> SampledBatch:
        """This rank's rows [r B, (r+1) B) of the group's next step of w B picks over every shard.

        Every rank splits the step the same way from the same draws (``step_rng(seed, step, SPLIT_KEY)``
        over the shards' sizes and masses, asked now): shard s picks c_s items (its own group step,
        made once on that daemon), and the w B rows take their shards in a seeded shuffled order; a rank
        takes, of each shard, the contiguous run of that shard's picks that falls in its rows. Masses and
        sizes come from what the shards reported, so every rank reports the same global probabilities.
        A shard that fails fails the batch (no re-split: the others' slices of its picks would differ).
        """
        group = self.group
        with self._lock:
            step, self.step = self.step, self.step + 1
        total = group.world_size * num_samples
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = EMPTY_POLL_S[0]
        while True:
            if self.closed:
                raise SamplerClosedError("this sampler is closed")
            policy, weights = self.weights()
            weights = {i: weights[i] for i in sorted(weights)}
            rng = step_rng(group.seed, step, SPLIT_KEY)
            counts = split(policy, list(weights.values()), total, rng)
            if counts:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.DeadlineExceededError(f"sample: table '{self.table}' has no item on any live shard "
                                                   f"within {timeout}s")
            time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(2 * wait, EMPTY_POLL_S[1])
        shard_order = sorted(counts)
        labels = np.repeat(np.array(shard_order), [counts[i] for i in shard_order])
        rng.shuffle(labels)  # row j of the step's w B rows comes from shard labels[j]
        first = group.rank * num_samples
        mine = labels[first:first + num_samples]
        running = {}
        for index in shard_order:
            take = int(np.count_nonzero(mine == index))
            if not take:
                continue
            part = GroupSlice(step, counts[index], int(np.count_nonzero(labels[:first] == index)))
            sampler = self._sampler(self.shards.shards[index])
            running[index] = self.shards.submit(sampler.sample_slice, part, take, window=window,
                                                timeout=None if deadline is None else
                                                max(0.001, deadline - time.monotonic()))
        pieces = {index: [future.result()] for index, future in running.items()}
        per_shard = {}
        for index, (piece,) in pieces.items():
            self.shards.key_owners.learn(piece.keys, index)
            per_shard[index] = (piece.priorities, piece.probabilities, piece.table_sizes)
        size, probabilities = globalise(policy, weights, per_shard, masses_from_answers=False)
        order = np.concatenate([np.flatnonzero(mine == index) for index in pieces])
        return assemble([p[0] for p in pieces.values()], rng, self.device, self._assembly,
                        probabilities=np.concatenate(probabilities) if len(probabilities) > 1 else probabilities[0],
                        table_size=size, order=order)

    def _plan(self, num_samples: int, timeout: float | None) -> _Plan:
        """Ask the shards (or reuse recent answers) and split ``num_samples``; waits while no shard has an item.

        Every draw of the seeded generator happens here, in the caller's thread and
        order, so batches fetched in parallel split and shuffle as a seeded run says.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = EMPTY_POLL_S[0]
        while True:
            if self.closed:
                raise SamplerClosedError("this sampler is closed")
            policy, weights = self._recent_weights()
            with self._lock:  # one generator, drawn in call order
                counts = split(policy, list(weights.values()), num_samples, self._rng)
                rng = np.random.default_rng(int(self._rng.integers(1 << 63))) if counts else None
            if counts:
                return _Plan(policy, weights, counts, rng, deadline)
            self._weights = None  # nothing to sample: ask again next time
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.DeadlineExceededError(f"sample: table '{self.table}' has no item on any live shard "
                                                   f"within {timeout}s")
            time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(2 * wait, EMPTY_POLL_S[1])

    def _fetch(self, plan: _Plan, window: WindowSpec) -> SampledBatch:
        """The planned parts, collected in parallel, with global probabilities, as one batch."""
        parts = self._collect(plan, window)
        return self._assemble(plan.policy, plan.weights, parts, plan.rng)

    def _fetch_ready(self, plan: _Plan, window: WindowSpec) -> SampledBatch:
        """``_fetch`` on a fetcher thread: the batch is complete on the device before the learner gets it
        (its copy was ordered on this thread's stream, which the learner's own streams know nothing of)."""
        batch = self._fetch(plan, window)
        if is_gpu_device(self.device):
            import cupy as cp

            with cp.cuda.Device(gpu_index(self.device)):
                cp.cuda.get_current_stream().synchronize()
        return batch

    def _assemble(self, policy: Policy, weights: dict[int, ShardWeight], pieces: dict[int, list[SampledBatch]],
                  rng: np.random.Generator) -> SampledBatch:
        """Every shard's pieces with the global probabilities and size, copied once into one batch.

        A shard may give several pieces (chunks of its stream, a part taken again
        after a failure): they join the others in one flat list, never assembled
        per shard first.
        """
        per_shard, flat = {}, []
        for index, ps in pieces.items():
            if len(ps) == 1:
                infos = (ps[0].keys, ps[0].priorities, ps[0].probabilities, ps[0].table_sizes)
            else:
                infos = tuple(np.concatenate([getattr(p, f) for p in ps])
                              for f in ("keys", "priorities", "probabilities", "table_sizes"))
            self.shards.key_owners.learn(infos[0], index)
            per_shard[index] = infos[1:]
            flat.extend(ps)
        size, probabilities = globalise(policy, weights, per_shard)
        return assemble(flat, rng, self.device, self._assembly,
                        probabilities=np.concatenate(probabilities) if len(probabilities) > 1 else probabilities[0],
                        table_size=size)

    def _collect(self, plan: _Plan, window: WindowSpec) -> dict[int, list[SampledBatch]]:
        """Every shard's part, in parallel; a failed shard's part is split again over the others."""
        policy, weights, deadline = plan.policy, plan.weights, plan.deadline
        got: dict[int, list[SampledBatch]] = {}
        running: dict[futures.Future, tuple[int, int]] = {}
        timed_out = None

        def start(shard_index: int, count: int) -> None:
            shard = self.shards.shards[shard_index]
            timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
            future = self.shards.submit(self._sampler(shard).sample, count, window=window, timeout=timeout)
            running[future] = (shard_index, count)

        for shard_index, count in plan.counts.items():
            start(shard_index, count)
        while running:
            done, _ = futures.wait(list(running), timeout=self.shards.timeout_s,
                                   return_when=futures.FIRST_COMPLETED)
            if not done:
                self._check_outstanding({running[f][0] for f in running})
                continue
            for future in done:
                shard_index, count = running.pop(future)
                shard = self.shards.shards[shard_index]
                try:
                    part = future.result()
                except errors.DeadlineExceededError as exc:
                    timed_out = exc  # the shard's rate limiter held its part past the timeout
                    continue
                except (errors.ReverbError, SamplerClosedError) as exc:
                    if self.closed:
                        raise SamplerClosedError("the sampler was closed while sampling") from exc
                    if not (isinstance(exc, SamplerClosedError) or is_unreachable(exc)):
                        raise
                    self._shard_failed(shard, exc)
                    weights.pop(shard_index, None)
                    self.resplits += 1
                    again = split(policy, list(weights.values()), count, plan.rng)
                    if not again:
                        raise errors.ServiceError(f"sample: no live shard of table '{self.table}' left "
                                                  f"({self._down_summary()})") from exc
                    for other, n in again.items():
                        start(other, n)
                    continue
                got.setdefault(shard_index, []).append(part)
                if len(part) < count:  # a timeout after some picks: a shorter batch, as one table gives
                    timed_out = timed_out or errors.DeadlineExceededError("sample: rate limiter timeout")
        if not got:
            raise timed_out or errors.ServiceError(f"sample: no shard of table '{self.table}' answered")
        return got

    def _check_outstanding(self, shard_indices: set[int]) -> None:
        """Parts still running after ``timeout_s``: probe their shards; a dead one's part is cut off."""
        shards = [self.shards.shards[i] for i in shard_indices]
        answers = self.shards.map(lambda s: s.server_info(self.shards.timeout_s), shards)
        for shard, answer in zip(shards, answers, strict=True):
            if isinstance(answer, BaseException) and is_unreachable(answer):
                self._shard_failed(shard, answer)  # closes its sampler: the part ends with SamplerClosedError

    def _shard_failed(self, shard: Shard, error: BaseException) -> None:
        self.shards.mark_down(shard, error)
        self._forget_sampler(shard)

    def _down_summary(self) -> str:
        down = [f"{s.address}: {s.last_error}" for s in self.shards.states() if not s.up]
        return "; ".join(down) if down else "every shard answered"

    # ----------------------------------------------------------------- many batches
    def batches(self, num_samples: int, *, window: WindowSpec = None, timeout: float | None = None,
                group_items: int = READ_AHEAD_ITEMS, depth: int = READ_AHEAD_GROUPS):
        """Batches without end, read ahead: for tables whose sampling takes nothing (the datasets decide).

        Uniform and prioritized tables stream every shard's picks in the background
        (``streams``): batches are cut from the streams by the split, with no round
        trip on the learner's path. Other samplers select several batches (up to
        ``group_items`` items) as one group: one split and one part per shard,
        shuffled and cut into batches (picks made together are independent draws
        just as picks made one batch at a time are), ``depth`` groups fetched at once.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if self.group is not None:  # one step at a time: every rank's rows of one global selection
            while True:
                yield self.sample_grouped(num_samples, window=window, timeout=timeout)
        policy, _ = self._recent_weights()
        if policy.kind in (UNIFORM, PRIORITIZED):
            yield from self._streamed(num_samples, window, timeout)
            return
        per_group = max(1, int(group_items) // num_samples)
        pending: deque[futures.Future] = deque()
        try:
            while True:
                while len(pending) < max(1, depth):
                    plan = self._plan(num_samples * per_group, timeout)
                    pending.append(self._fetcher.submit(self._fetch_ready, plan, window))
                group = pending.popleft().result()
                yield from _batches_of(group, num_samples)
        finally:
            for future in pending:
                future.cancel()

    def _streamed(self, num_samples: int, window: WindowSpec, timeout: float | None):
        """Batches cut from the shards' streams (see ``streams``), a group of up to ``STREAM_GROUP_BATCHES``
        at a time: one split, one take and one assembly (one kernel launch on a GPU) for the group, whose
        rows are shuffled together and cut into batches (independent draws, as the other samplers' groups):
        the learner's thread pays its per-assembly Python once per group, not once per batch."""
        streams: dict[int, ShardStream] = {}
        chunk = max(STREAM_MIN_CHUNK, num_samples)  # a batch a chunk: each takes ~its share of one, in ~1 piece
        group = num_samples * group_batches(num_samples)
        asked = -math.inf
        with self._lock:  # this generator's own (seeded from the sampler's: seeded runs reproduce)
            rng = np.random.default_rng(int(self._rng.integers(1 << 63)))
        try:
            while True:
                if self.closed:
                    raise SamplerClosedError("this sampler is closed")
                live = {s.index: s for s in self.shards.live()}
                for index in [i for i in streams if i not in live]:
                    self._end_stream(streams, index)
                now = time.monotonic()
                if set(live) - set(streams) or now - asked >= STREAM_WEIGHTS_REFRESH_S:
                    policy, weights = self.weights()  # a shard (re)joined, or time to hear from the idle ones
                    for index, weight in weights.items():
                        if index not in streams:
                            most = -(-STREAM_CHUNK_BATCHES * num_samples // max(1, len(live)))
                            streams[index] = self._start_stream(live[index], policy, chunk, window, weight, most)
                        else:
                            streams[index].reported(weight, asked)
                    asked = now
                policy = self._policy
                current = {i: st.weight for i, st in streams.items() if st.weight is not None}
                with self._lock:
                    counts = split(policy, list(current.values()), group, self._rng)
                if not counts:  # no item anywhere yet: the streams wait for the first ones
                    counts = {i: 0 for i in streams}
                pieces = self._take(streams, policy, counts, group, rng, timeout)
                if not pieces:
                    continue
                latest = {i: st.weight for i, st in streams.items() if st.weight is not None}
                assembled = self._assemble(policy, latest, pieces, rng)
                item_bytes = sum(int(c.nbytes) for c in assembled.columns) // max(1, len(assembled))
                group = num_samples * group_batches(num_samples, item_bytes)
                yield from _batches_of(assembled, num_samples)
        finally:
            for index in list(streams):
                self._end_stream(streams, index)

    def _take(self, streams: dict[int, ShardStream], policy: Policy, counts: dict[int, int], total: int,
              rng: np.random.Generator, timeout: float | None) -> dict[int, list[SampledBatch]]:
        """Each shard's count from its stream, as pieces of its chunks (views, nothing copied); a failed
        shard's count is split again over the others."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {i: n for i, n in counts.items() if n > 0}
        if not pending:  # no item on any shard yet
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.DeadlineExceededError(f"sample: table '{self.table}' has no item on any live shard")
            time.sleep(EMPTY_POLL_S[1])
            return {}
        pieces: dict[int, list[SampledBatch]] = {}
        while pending:
            for index, n in list(pending.items()):
                stream = streams.get(index)
                try:
                    if stream is None:
                        raise StreamError("the shard left")
                    wait = self.shards.timeout_s if deadline is None else \
                        max(0.0, min(self.shards.timeout_s, deadline - time.monotonic()))
                    got, missing = stream.take(n, wait)
                except StreamError as exc:
                    cause = exc.__cause__ or exc
                    if self.closed:
                        raise SamplerClosedError("the sampler was closed while sampling") from cause
                    if not (closed_error(exc) or is_unreachable(cause) or stream is None):
                        raise cause from exc
                    self._shard_failed(self.shards.shards[index], cause)
                    self._end_stream(streams, index)
                    pending.pop(index)
                    self.resplits += 1
                    again = split(policy, [st.weight for st in streams.values() if st.weight is not None], n, rng)
                    if not again:
                        raise errors.ServiceError(f"sample: no live shard of table '{self.table}' left "
                                                  f"({self._down_summary()})") from cause
                    for other, k in again.items():
                        pending[other] = pending.get(other, 0) + k
                    continue
                pieces.setdefault(index, []).extend(got)
                if missing:
                    pending[index] = missing
                    self._check_outstanding({index})  # nothing for a while: is the shard still there?
                    if not self.shards.shards[index].up:
                        self._end_stream(streams, index)
                    if deadline is not None and time.monotonic() >= deadline:
                        raise errors.DeadlineExceededError(f"sample: no batch of table '{self.table}' within "
                                                           f"{timeout}s")
                else:
                    pending.pop(index)
        return {i: ps for i, ps in pieces.items() if ps}

    def _start_stream(self, shard: Shard, policy: Policy, chunk: int, window: WindowSpec,
                      weight: ShardWeight, most: int) -> ShardStream:
        sampler = PlaneSampler(shard.client, self.table, planes=self.planes, device=self.device, **self._plane_options)
        stream = ShardStream(shard, sampler, policy, chunk, window, weight, most)
        with self._lock:
            self._streams.add(stream)
        return stream

    def _end_stream(self, streams: dict[int, ShardStream], index: int) -> None:
        stream = streams.pop(index, None)
        if stream is not None:
            with self._lock:
                self._streams.discard(stream)
                if stream.sampler.kind is not None:
                    self._ended_kinds[index] = stream.sampler.kind
            stream.close()

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close every shard's session (a sample blocked in another thread ends with SamplerClosedError)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            samplers, self._samplers = list(self._samplers.values()), {}
        for sampler in samplers:
            sampler.close()
        with self._lock:
            streams, self._streams = list(self._streams), set()
        for stream in streams:
            stream.close()
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        if isinstance(self._assembly, DeviceAssembly):
            self._assembly.synchronize()
        else:
            self._assembly.clear()
        if self._owns_shards:
            self.shards.close()

    def __enter__(self) -> ShardedSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def group_batches(num_samples: int, item_bytes: int | None = None) -> int:
    """Batches of ``num_samples`` items a streamed group assembles together: up to STREAM_GROUP_BATCHES and
    STREAM_GROUP_BYTES (``item_bytes``: one item's bytes, None before any came: then STREAM_GROUP_ITEMS items).
    Small items make the most of it: a batch of 4096 keys pays a quarter of a group's Python."""
    if item_bytes is None:
        fit = STREAM_GROUP_ITEMS // num_samples
    else:
        fit = STREAM_GROUP_BYTES // max(1, int(item_bytes) * num_samples)
    return max(1, min(STREAM_GROUP_BATCHES, fit))


def _batches_of(group: SampledBatch, num_samples: int):
    """A group's rows cut into batches of ``num_samples`` (views; the last may be shorter)."""
    for start in range(0, len(group), num_samples):
        yield rows(group, start, min(start + num_samples, len(group)))
