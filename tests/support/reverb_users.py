"""Code written the way third-party Reverb users write it, for tests/compat/test_third_party.py.

Each class re-tells, in our own words and reduced to its Reverb calls, what a
well-known Reverb user does: Acme's reverb adders (N-step transitions and
fixed-length sequences on ``TrajectoryWriter``, the ``StructuredWriter`` adder
and its config builders) and TF-Agents' observers (``ReverbAddTrajectoryObserver``,
``ReverbAddEpisodeObserver``). Like the originals it says ``import reverb`` and
walks the writer's history with dm-tree (TF-Agents' ``tf.nest`` treats leaves the
same way). The test module makes ``import reverb`` find gear's opt-in alias.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sized
from typing import Any, NamedTuple

import numpy as np
import reverb
import tree
from reverb import structured_writer as sw

DEFAULT_PRIORITY_TABLE = "priority_table"


class Step(NamedTuple):
    """One row of an Acme episode (Acme's reverb ``base.Step``)."""

    observation: Any
    action: Any
    reward: Any
    discount: Any
    start_of_episode: Any
    extras: Any = ()


class Trajectory(NamedTuple):
    """Acme's ``base.Trajectory``: the stacked fields of several steps."""

    observation: Any
    action: Any
    reward: Any
    discount: Any
    start_of_episode: Any
    extras: Any = ()


class Transition(NamedTuple):
    """Acme's ``types.Transition``."""

    observation: Any
    action: Any
    reward: Any
    discount: Any
    next_observation: Any
    extras: Any = ()


class TimeStep(NamedTuple):
    """dm_env's TimeStep, reduced to what the adders read."""

    step_type: int  # 0 first, 1 mid, 2 last
    reward: Any
    discount: Any
    observation: Any

    def first(self) -> bool:
        return self.step_type == 0

    def last(self) -> bool:
        return self.step_type == 2


def episode(length: int, obs_dim: int = 3) -> list[tuple[Any, TimeStep]]:
    """(action, next timestep) pairs after a first timestep: obs t is full(obs_dim, t), reward t+1."""
    steps = []
    for t in range(1, length + 1):
        kind = 2 if t == length else 1
        steps.append((np.int32(t - 1), TimeStep(kind, np.float32(t), np.float32(0.0 if kind == 2 else 1.0),
                                                np.full(obs_dim, t, np.float32))))
    return steps


def first_timestep(obs_dim: int = 3) -> TimeStep:
    return TimeStep(0, None, None, np.zeros(obs_dim, np.float32))


class TrajectoryWriterAdder:
    """Acme's ``ReverbAdder`` on ``client.trajectory_writer``: partial steps, zero-padded last row, end_episode."""

    def __init__(self, client: reverb.Client, max_sequence_length: int,
                 priority_fns: dict[str, Callable[[Any], float]] | None = None, max_in_flight_items: int = 2):
        self._client = client
        self._max_sequence_length = max_sequence_length
        self._priority_fns = priority_fns or {DEFAULT_PRIORITY_TABLE: lambda _: 1.0}
        self._max_in_flight_items = max_in_flight_items
        self.__writer = None
        self._add_first_called = False

    @property
    def _writer(self) -> reverb.TrajectoryWriter:
        if self.__writer is None:
            self.__writer = self._client.trajectory_writer(
                num_keep_alive_refs=self._max_sequence_length, get_signature_timeout_ms=300_000)
        return self.__writer

    def priorities(self, trajectory: Any) -> dict[str, float]:
        """Acme's ``utils.calculate_priorities``: the columns as numpy for each priority function."""
        if any(fn is not None for fn in self._priority_fns.values()):
            trajectory = tree.map_structure(lambda col: col.numpy(), trajectory)
        return {table: (fn(trajectory) if fn else 1.0) for table, fn in self._priority_fns.items()}

    def reset(self, timeout_ms: int | None = None) -> None:
        if self.__writer is not None:
            self.__writer.end_episode(clear_buffers=True, timeout_ms=timeout_ms)
        self._add_first_called = False

    def close(self) -> None:
        if self.__writer is not None:
            self.__writer.close()
            self.__writer = None

    def add_first(self, timestep: TimeStep) -> None:
        if not timestep.first():
            raise ValueError("add_first takes the first timestep of an episode")
        self._writer.append({"observation": timestep.observation, "start_of_episode": timestep.first()},
                            partial_step=True)
        self._add_first_called = True

    def add(self, action: Any, next_timestep: TimeStep, extras: Any = ()) -> None:
        if not self._add_first_called:
            raise ValueError("adder.add_first must be called before adder.add.")
        has_extras = len(extras) > 0 if isinstance(extras, Sized) else extras is not None
        current_step = {"action": action, "reward": next_timestep.reward, "discount": next_timestep.discount,
                        **({"extras": extras} if has_extras else {})}
        self._writer.append(current_step)
        self._writer.append({"observation": next_timestep.observation,
                             "start_of_episode": next_timestep.first()}, partial_step=True)
        self._write()
        if next_timestep.last():
            # The last row gets zeros in the fields that only the observation row lacks.
            self._writer.append(tree.map_structure(np.zeros_like, current_step))
            self._write_last()
            self.reset()

    def _write(self) -> None:
        raise NotImplementedError

    def _write_last(self) -> None:
        raise NotImplementedError


class NStepTransitionAdder(TrajectoryWriterAdder):
    """Acme's N-step transition adder: positive history indices from the episode start, ``[a:b].numpy()``."""

    def __init__(self, client: reverb.Client, n_step: int, discount: float, **kwargs: Any):
        self.n_step = n_step
        self._discount = np.float32(discount)
        self._first_idx = 0
        self._last_idx = 0
        super().__init__(client, max_sequence_length=n_step + 1, **kwargs)

    def add(self, *args: Any, **kwargs: Any) -> None:
        if self._writer.episode_steps >= self.n_step:
            self._first_idx += 1
        self._last_idx += 1
        super().add(*args, **kwargs)

    def reset(self, timeout_ms: int | None = None) -> None:
        super().reset(timeout_ms)
        self._first_idx = 0
        self._last_idx = 0

    def _write(self) -> None:
        history = self._writer.history
        s, a = tree.map_structure(lambda x: x[self._first_idx], (history["observation"], history["action"]))
        s_next = tree.map_structure(lambda x: x[self._last_idx], history["observation"])
        extras = tree.map_structure(lambda x: x[self._first_idx], history["extras"]) if "extras" in history else ()
        rewards, discounts = tree.map_structure(lambda x: x[self._first_idx:self._last_idx].numpy(),
                                                (history["reward"], history["discount"]))
        n_step_return, total_discount = rewards[0].copy(), discounts[0].copy()
        for i in range(1, len(rewards)):
            total_discount *= self._discount
            n_step_return += rewards[i] * total_discount
            total_discount *= discounts[i]
        self._writer.append({"n_step_return": n_step_return, "total_discount": total_discount},
                            partial_step=self._writer.episode_steps <= self._last_idx)
        history = self._writer.history
        n_step_return, total_discount = tree.map_structure(
            lambda x: x[-1], (history["n_step_return"], history["total_discount"]))
        transition = Transition(observation=s, action=a, reward=n_step_return, discount=total_discount,
                                next_observation=s_next, extras=extras)
        for table, priority in self.priorities(transition).items():
            self._writer.create_item(table=table, priority=priority, trajectory=transition)
            self._writer.flush(self._max_in_flight_items)

    def _write_last(self) -> None:
        self._first_idx += 1
        while self._first_idx < self._last_idx:
            self._write()
            self._first_idx += 1


class SequenceAdder(TrajectoryWriterAdder):
    """Acme's sequence adder (end behaviour ZERO_PAD): ``itemgetter(slice(...))`` over the whole history."""

    def __init__(self, client: reverb.Client, sequence_length: int, period: int, **kwargs: Any):
        self._sequence_length = sequence_length
        self._period = period
        # One more row than a sequence: the open row of the next observation.
        super().__init__(client, max_sequence_length=sequence_length + 1, **kwargs)

    def _write(self) -> None:
        self._maybe_create_item(self._sequence_length)

    def _write_last(self) -> None:
        # Pad with zero steps until the next write would have happened, then write.
        steps = self._writer.episode_steps
        if steps < self._sequence_length:
            padding = self._sequence_length - steps
        else:
            padding = (self._period - (steps - self._sequence_length)) % self._period
        zero_step = tree.map_structure(lambda x: np.zeros_like(x[-2].numpy()), self._writer.history)
        for _ in range(padding):
            self._writer.append(zero_step)
        self._maybe_create_item(self._sequence_length, end_of_episode=True, force=True)

    def _maybe_create_item(self, sequence_length: int, *, end_of_episode: bool = False, force: bool = False) -> None:
        steps = self._writer.episode_steps
        first_write = steps == sequence_length
        period_reached = steps > sequence_length and (steps - sequence_length) % self._period == 0
        if not first_write and not period_reached and not force:
            return
        # Mid-episode the newest row is the open observation row: the item ends one row earlier.
        get_traj = (operator.itemgetter(slice(-sequence_length - 1, -1)) if not end_of_episode
                    else operator.itemgetter(slice(-sequence_length, None)))
        trajectory = Trajectory(**tree.map_structure(get_traj, self._writer.history))
        for table, priority in self.priorities(trajectory).items():
            self._writer.create_item(table, priority, trajectory)
            self._writer.flush(self._max_in_flight_items)


def create_step_spec(obs_spec: Any, action_spec: Any, scalar_spec: Callable[[str, Any], Any]) -> Step:
    """Acme's ``create_step_spec``: the environment's specs plus start_of_episode (bool) and no extras."""
    return Step(observation=obs_spec, action=action_spec, reward=scalar_spec("reward", np.float32),
                discount=scalar_spec("discount", np.float32),
                start_of_episode=scalar_spec("start_of_episode", np.bool_), extras=())


def n_step_transition_configs(step_spec: Step, n_step: int, table: str = DEFAULT_PRIORITY_TABLE) -> list:
    """Acme's ``create_n_step_transition_config``: strided and offset slices of a reference step."""

    def pattern(n: int) -> Any:
        ref_step = sw.create_reference_step(step_spec)
        get_first = lambda x: x[-(n + 1):-n]  # noqa: E731
        get_all = lambda x: x[-(n + 1):-1]  # noqa: E731
        get_first_and_last = lambda x: x[-(n + 1)::n]  # noqa: E731
        return Trajectory(
            observation=tree.map_structure(get_first_and_last, ref_step.observation),
            action=tree.map_structure(get_first, ref_step.action),
            reward=tree.map_structure(get_all, ref_step.reward),
            discount=tree.map_structure(get_all, ref_step.discount),
            start_of_episode=tree.map_structure(get_first, ref_step.start_of_episode),
            extras=tree.map_structure(get_first, ref_step.extras))

    start = [sw.create_config(pattern=pattern(n), table=table, conditions=[sw.Condition.step_index() == n])
             for n in range(1, n_step)]
    base = sw.create_config(pattern=pattern(n_step), table=table)
    end = [sw.create_config(pattern=pattern(n), table=table,
                            conditions=[sw.Condition.is_end_episode(), sw.Condition.step_index() != n])
           for n in range(n_step - 1, 0, -1)]
    return start + [base] + end


def sequence_configs(step_spec: Step, sequence_length: int, period: int,
                     table: str = DEFAULT_PRIORITY_TABLE) -> list:
    """Acme's ``create_sequence_config`` with end behaviour TRUNCATE."""

    def pattern(n: int) -> Any:
        return sw.pattern_from_transform(step_spec, lambda step: Trajectory(*tree.map_structure(lambda x: x[-n:],
                                                                                                 step)))

    base = sw.create_config(pattern=pattern(sequence_length), table=table, conditions=[
        sw.Condition.step_index() >= sequence_length - 1,
        sw.Condition.step_index() % period == (sequence_length - 1) % period])
    target = (sequence_length - 1) % period
    end = []
    for x in range(period):
        if x == target:
            continue
        end.append(sw.create_config(pattern=pattern(sequence_length - (target - x) % period), table=table,
                                    conditions=[sw.Condition.is_end_episode(), sw.Condition.step_index() % period == x,
                                                sw.Condition.step_index() >= sequence_length]))
    for x in range(1, sequence_length):
        end.append(sw.create_config(pattern=pattern(x), table=table, conditions=[
            sw.Condition.is_end_episode(), sw.Condition.step_index() == x - 1]))
    return [base] + end


class StructuredAdder:
    """Acme's ``StructuredAdder``: configs checked with ``infer_signature``, Steps with None holes."""

    def __init__(self, client: reverb.Client, max_in_flight_items: int, configs: list, step_spec: Step):
        for config in configs:
            sw.infer_signature([config], step_spec)
        self._client = client
        self._configs = tuple(configs)
        self._none_step = tree.map_structure(lambda _: None, step_spec)
        self._max_in_flight_items = max_in_flight_items
        self._writer = None

    def _make_step(self, **kwargs: Any) -> Step:
        return Step(**{**self._none_step._asdict(), **kwargs})

    def reset(self, timeout_ms: int | None = None) -> None:
        if self._writer is not None:
            self._writer.end_episode(clear_buffers=True, timeout_ms=timeout_ms)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush(0, timeout_ms=10_000)
            self._writer.close()
            self._writer = None

    def add_first(self, timestep: TimeStep) -> None:
        if self._writer is None:
            self._writer = self._client.structured_writer(self._configs)
        self._writer.append(data=self._make_step(observation=timestep.observation,
                                                 start_of_episode=timestep.first()), partial_step=True)
        self._writer.flush(self._max_in_flight_items)

    def add(self, action: Any, next_timestep: TimeStep, extras: Any = ()) -> None:
        if self._writer is None or not self._writer.step_is_open:
            raise ValueError("adder.add_first must be called before adder.add.")
        current_step = self._make_step(action=action, reward=next_timestep.reward, discount=next_timestep.discount,
                                       extras=extras if extras else self._none_step.extras)
        self._writer.append(current_step)
        self._writer.append(data=self._make_step(observation=next_timestep.observation,
                                                 start_of_episode=next_timestep.first()), partial_step=True)
        self._writer.flush(self._max_in_flight_items)
        if next_timestep.last():
            self._writer.append(tree.map_structure(lambda x: None if x is None else np.zeros_like(x), current_step))
            self.reset()


class TFAgentsTrajectory(NamedTuple):
    """TF-Agents' ``Trajectory`` (policy_info is often an empty tuple)."""

    step_type: Any
    observation: Any
    action: Any
    policy_info: Any
    next_step_type: Any
    reward: Any
    discount: Any

    def is_boundary(self) -> bool:
        return int(self.step_type) == 2


class ReverbAddTrajectoryObserver:
    """TF-Agents' observer of fixed-length windows, ``stride_length`` apart, optionally padding episode ends."""

    def __init__(self, py_client: reverb.Client, table_name: str | list[str], sequence_length: int,
                 stride_length: int = 1, priority: float | int = 1, pad_end_of_episodes: bool = False):
        self._table_names = [table_name] if isinstance(table_name, str) else table_name
        self._sequence_length = sequence_length
        self._stride_length = stride_length
        self._priority = priority
        self._pad_end_of_episodes = pad_end_of_episodes
        self._writer = py_client.trajectory_writer(num_keep_alive_refs=sequence_length + 1,
                                                   get_signature_timeout_ms=None)
        self._cached_steps = 0
        self._last_trajectory: TFAgentsTrajectory | None = None

    def __call__(self, trajectory: TFAgentsTrajectory) -> None:
        self._last_trajectory = trajectory
        self._writer.append(trajectory)
        self._cached_steps += 1
        self._write_cached_steps()
        if trajectory.is_boundary():
            self.reset(write_cached_steps=self._pad_end_of_episodes)

    def _write_cached_steps(self) -> None:
        if self._cached_steps >= self._sequence_length and \
                (self._cached_steps - self._sequence_length) % self._stride_length == 0:
            trajectory = tree.map_structure(lambda d: d[-self._sequence_length:], self._writer.history)
            for table_name in self._table_names:
                self._writer.create_item(table=table_name, trajectory=trajectory, priority=self._priority)

    def flush(self) -> None:
        self._writer.flush()

    def reset(self, write_cached_steps: bool = True) -> None:
        if write_cached_steps and self._last_trajectory is not None and self._cached_steps:
            # Padding: boundary steps of zeros until the last real step leaves the window.
            zero_step = tree.map_structure(np.zeros_like, self._last_trajectory)
            zero_step = zero_step._replace(step_type=np.asarray(2, np.int32), next_step_type=np.asarray(0, np.int32))
            padded = 0
            while padded < self._sequence_length - 1:
                self._writer.append(zero_step)
                self._cached_steps += 1
                padded += 1
                self._write_cached_steps()
        self._writer.end_episode(clear_buffers=True)
        self._cached_steps = 0
        self._last_trajectory = None

    def close(self) -> None:
        self._writer.end_episode()
        self._writer.close()


class ReverbAddEpisodeObserver:
    """TF-Agents' whole-episode observer: one item of ``history[:]`` per episode, into several tables."""

    def __init__(self, py_client: reverb.Client, table_name: str | list[str], max_sequence_length: int,
                 priority: float | int = 1):
        self._table_names = [table_name] if isinstance(table_name, str) else table_name
        self._max_sequence_length = max_sequence_length
        self._priority = priority
        self._writer = py_client.trajectory_writer(num_keep_alive_refs=max_sequence_length + 1,
                                                   get_signature_timeout_ms=None)
        self._cached_steps = 0

    def __call__(self, trajectory: TFAgentsTrajectory) -> None:
        if self._cached_steps >= self._max_sequence_length:
            raise ValueError("The number of trajectories within the same episode exceeds `max_sequence_length`.")
        self._writer.append(trajectory)
        self._cached_steps += 1
        if trajectory.is_boundary():
            trajectory = tree.map_structure(lambda h: h[:], self._writer.history)
            for table_name in self._table_names:
                self._writer.create_item(table=table_name, trajectory=trajectory, priority=self._priority)
            self._writer.end_episode()
            self._cached_steps = 0

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.end_episode()
        self._writer.close()


def tf_agents_episode(length: int) -> list[TFAgentsTrajectory]:
    """Steps of one episode as TF-Agents' driver hands them to observers (the last one a boundary)."""
    out = []
    for t in range(length):
        step_type = 0 if t == 0 else (2 if t == length - 1 else 1)
        next_type = 2 if t >= length - 2 else 1
        out.append(TFAgentsTrajectory(
            step_type=np.asarray(step_type, np.int32), observation={"pixels": np.full((2, 2), t, np.uint8),
                                                                    "velocity": np.float32(t)},
            action=np.asarray(t % 3, np.int64), policy_info=(), next_step_type=np.asarray(next_type, np.int32),
            reward=np.asarray(t, np.float32), discount=np.asarray(0.0 if next_type == 2 else 1.0, np.float32)))
    return out
