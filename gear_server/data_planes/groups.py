"""Selection groups: the data-parallel ranks of one learner sharing one selection per step.

Each rank opens its own data-plane session naming the group (id, world size,
its rank, a seed). Step k's Select of every rank refers to one selection: the
first rank to ask picks the step's items once, drawn from a generator keyed by
(seed, k), under one table lease; each rank then takes its slice of them, which
moves those picks to a table lease of its own (``Table.split_lease``) held by
its session's lease like any Select's. The picks are counted once (times
sampled, rate limiter); the probabilities and table sizes are those of the one
selection, so importance weights are the global ones.

Memory is bounded whatever the ranks do: a group holds at most
``MAX_PENDING_STEPS`` steps not fully taken (the oldest is dropped, its
untaken picks released, when another is made), a step not fully taken within
the lease timeout is dropped by the reaper, and a group ends (its steps
released) with the last session in it. A rank asking for a step that was
dropped is refused (``StepGone``), never handed another selection under that step.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.selectors import step_rng

__all__ = ["GroupRegistry", "GroupStep", "MakerLeft", "SelectionGroup", "SliceSelection", "StepGone",
           "step_rng"]

MAX_PENDING_STEPS = 64  # steps of one group not fully taken yet
MAX_REMEMBERED_STEPS = 4096  # steps of one group remembered as taken or dropped (to refuse them again)
MAX_GROUP_ID = 256


class StepGone(LookupError):
    """The step was dropped (expired, or too many steps pending) or already fully taken."""


class MakerLeft(Exception):
    """The rank making a step's selection left before it was made (its call ended): another rank makes it."""


class GroupStep:
    """One step's selection while ranks take their slices of it."""

    def __init__(self, step: int, asked: int, created: float):
        self.step = step
        self.asked = asked  # picks the step was asked for (every rank must ask the same)
        self.created = created
        self.ready: concurrent.futures.Future = concurrent.futures.Future()  # the JoinedSelection
        self.taken: np.ndarray | None = None  # bool per pick, once ready
        self.left = 0


class SelectionGroup:
    """A table's group: its ranks' sessions and the steps they have not all taken yet."""

    def __init__(self, table: Any, group_id: str, world_size: int, seed: int):
        self.table = table
        self.group_id = group_id
        self.world_size = world_size
        self.seed = seed
        self.sessions: set[str] = set()
        self.steps: OrderedDict[int, GroupStep] = OrderedDict()
        self.ended: OrderedDict[int, str] = OrderedDict()  # step -> why it is gone

    def end(self, step: int, why: str) -> None:
        self.ended[step] = why
        while len(self.ended) > MAX_REMEMBERED_STEPS:
            self.ended.popitem(last=False)


class SliceSelection:
    """A rank's slice of a step's selection, as the Select answer needs it."""

    _ARRAYS = ("slots", "generations", "lengths", "keys", "probabilities", "table_sizes", "priorities",
               "times_sampled")

    def __init__(self, joined: Any, start: int, stop: int, table_leases: list[int]):
        for name in self._ARRAYS:
            setattr(self, name, getattr(joined, name)[start:stop])
        self.layout_version = joined.layout_version
        self.lease_ids = table_leases

    def __len__(self) -> int:
        return len(self.slots)


class GroupRegistry:
    """The daemon's selection groups (thread safe); table work is done under its lock, table lock inside."""

    def __init__(self, ttl_s: float, *, max_pending_steps: int = MAX_PENDING_STEPS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = float(ttl_s)
        self.max_pending_steps = int(max_pending_steps)
        self._clock = clock
        self._groups: dict[tuple[str, str], SelectionGroup] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ membership
    def join(self, table: Any, spec: pb.SelectionGroup, session_id: str) -> SelectionGroup:
        """Add a session to its group (made by the first rank); ValueError naming what does not fit."""
        group_id, world, rank, seed = spec.group_id, int(spec.world_size), int(spec.rank), int(spec.seed)
        if not group_id or len(group_id) > MAX_GROUP_ID:
            raise ValueError(f"a selection group needs a group_id of 1 to {MAX_GROUP_ID} characters")
        if world < 1:
            raise ValueError(f"a selection group's world_size must be >= 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world_size {world})")
        with self._lock:
            key = (table.name, group_id)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = SelectionGroup(table, group_id, world, seed)
            elif group.world_size != world or group.seed != seed:
                raise ValueError(f"selection group '{group_id}' of table '{table.name}' has world_size "
                                 f"{group.world_size} and seed {group.seed}; this rank asked for {world} and {seed}")
            group.sessions.add(session_id)
            return group

    def leave(self, group: SelectionGroup, session_id: str) -> None:
        """Remove a session; the last one ends the group and releases its pending steps."""
        with self._lock:
            group.sessions.discard(session_id)
            if group.sessions:
                return
            if self._groups.get((group.table.name, group.group_id)) is group:
                del self._groups[(group.table.name, group.group_id)]
            for step in list(group.steps.values()):
                self._drop(group, step, "the group ended")

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def pending_steps(self) -> int:
        """Steps not fully taken, over every group."""
        with self._lock:
            return sum(len(g.steps) for g in self._groups.values())

    # ------------------------------------------------------------ steps
    def begin(self, group: SelectionGroup, step: int, asked: int) -> tuple[GroupStep, bool, list[Any]]:
        """Step ``step`` of ``group``, whether the caller makes its selection (then ``made`` or ``failed``),
        and the selections of steps this dropped (too many pending: ``release`` them, off the event loop).

        StepGone if it was dropped or fully taken; ValueError if ranks disagree on its size. Takes no
        table lock: the event loop calls it.
        """
        with self._lock:
            why = group.ended.get(step)
            if why is not None:
                raise StepGone(f"step {step} of selection group '{group.group_id}' is gone ({why})")
            pending = group.steps.get(step)
            if pending is not None:
                if pending.asked != asked:
                    raise ValueError(f"step {step} of selection group '{group.group_id}' holds {pending.asked} "
                                     f"picks; this rank asked for a step of {asked}")
                return pending, False, []
            pending = group.steps[step] = GroupStep(step, asked, self._clock())
            dropped: list[Any] = []
            while len(group.steps) > self.max_pending_steps:
                _, oldest = next(iter(group.steps.items()))
                self._drop(group, oldest, f"more than {self.max_pending_steps} steps were pending", dropped)
            return pending, True, dropped

    @staticmethod
    def release(table: Any, selections: list[Any]) -> None:
        """Release the untaken picks of dropped steps (``begin``'s third answer; takes the table's lock)."""
        for selection in selections:
            _release_all(table, selection)

    def made(self, group: SelectionGroup, step: GroupStep, selection: Any) -> None:
        """The creator's selection for ``step``; released at once if the step was dropped meanwhile."""
        with self._lock:
            step.taken = np.zeros(len(selection), np.bool_)
            step.left = len(selection)
            step.ready.set_result(selection)
            if group.steps.get(step.step) is not step:
                _release_all(group.table, selection)

    def failed(self, group: SelectionGroup, step: GroupStep, error: BaseException) -> None:
        """The selection could not be made: the step is forgotten (a rank asking again makes it anew)."""
        with self._lock:
            if group.steps.get(step.step) is step:
                del group.steps[step.step]
            if not step.ready.done():
                step.ready.set_exception(error)

    def claim(self, group: SelectionGroup, step: GroupStep, start: int, stop: int) -> SliceSelection:
        """Picks [start, stop) of a ready step under table leases of their own (clipped to the picks made).

        StepGone if the step was dropped meanwhile; ValueError if a pick of that range was taken already.
        """
        selection = step.ready.result(timeout=0)
        with self._lock:
            if group.steps.get(step.step) is not step:
                raise StepGone(f"step {step.step} of selection group '{group.group_id}' is gone "
                               f"({group.ended.get(step.step, 'dropped')})")
            stop = min(stop, len(selection))
            start = min(start, stop)
            if step.taken[start:stop].any():
                raise ValueError(f"picks [{start}, {stop}) of step {step.step} of selection group "
                                 f"'{group.group_id}' were taken already (two ranks with one rank number?)")
            leases = []
            offset = 0
            for part in selection.parts:
                lo, hi = max(start, offset), min(stop, offset + len(part))
                if lo < hi:  # the part's lease holds its untaken picks, in order
                    before = int(step.taken[offset:lo].sum())
                    leases.append(group.table.split_lease(part.lease_id, lo - offset - before, hi - offset - before))
                offset += len(part)
            step.taken[start:stop] = True
            step.left -= stop - start
            if step.left == 0:
                del group.steps[step.step]
                group.end(step.step, "every pick was taken")
        return SliceSelection(selection, start, stop, leases)

    def reap(self) -> int:
        """Drop the steps made longer than the TTL ago and not fully taken; returns how many."""
        now = self._clock()
        dropped = 0
        with self._lock:
            for group in self._groups.values():
                for step in list(group.steps.values()):
                    if step.ready.done() and now - step.created > self.ttl_s:
                        self._drop(group, step, f"not taken by every rank within {self.ttl_s:g} s")
                        dropped += 1
        return dropped

    def _drop(self, group: SelectionGroup, step: GroupStep, why: str, later: list[Any] | None = None) -> None:
        """Forget a step and release its untaken picks, now or, with ``later``, by the caller (lock held);
        a step still being made is released by ``made``."""
        group.steps.pop(step.step, None)
        group.end(step.step, why)
        if step.ready.done() and step.ready.exception() is None:
            if later is None:
                _release_all(group.table, step.ready.result())
            else:
                later.append(step.ready.result())


def _release_all(table: Any, selection: Any) -> None:
    for part in selection.parts:
        try:
            table.release(part.lease_id)
        except Exception:  # noqa: BLE001 - a closed table has nothing left to release
            pass
