"""Structured-writer configs: patterns, conditions and priority functions (Reverb's patterns_pb2 and helpers).

A *pattern* says, for every leaf of the item, which recent steps of which
appended field it takes (``ref['obs'][-3:]``, ``ref['action'][-1]``); a
*config* pairs a pattern with a table, *conditions* on when to apply it
(every step, every other step, at the end of the episode, when a flag in the
data is set...) and a *priority* function (a constant, or the TD error of a
field). ``structured_writer.StructuredWriter`` applies them.

Reverb keeps configs as protos (patterns_pb2); here they are plain Python
objects with the same field names, built by the same functions
(``create_config``, ``pattern_from_transform``, ``Condition``,
``constant_priority_fn``, ``td_error``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gear_contract import nest
from gear_contract.specs import TensorSpec, as_program_specs, to_tensor_spec

__all__ = [
    "ApplyState",
    "Condition",
    "ConditionProto",
    "Config",
    "PatternNode",
    "Priority",
    "constant_priority_fn",
    "create_config",
    "create_reference_step",
    "infer_signature",
    "items_to_create",
    "pattern_from_transform",
    "td_error",
    "unpack_pattern",
]


@dataclasses.dataclass(frozen=True)
class PatternNode:
    """Steps of one appended field: ``[start:stop:step]`` when ``start`` is set, else the single step ``stop``.

    Indices count back from the most recent step (negative), as in Reverb.
    """

    flat_source_index: int
    start: int | None = None
    stop: int | None = None
    step: int | None = None

    def HasField(self, name: str) -> bool:  # noqa: N802 - Reverb code calls the proto method
        return getattr(self, name) is not None

    @property
    def is_slice(self) -> bool:
        return self.start is not None

    def history_needed(self) -> int:
        """How many most recent steps must exist for this node to apply."""
        if self.start is not None:
            return -self.start
        return -self.stop if self.stop is not None else 1

    def validate(self) -> None:
        if self.flat_source_index < 0:
            raise ValueError(f"flat_source_index must be >= 0, got {self.flat_source_index}")
        if self.start is None:
            if self.stop is None or self.stop >= 0:
                raise ValueError(f"a single-step node needs a negative index, got {self.stop}")
            if self.step is not None:
                raise ValueError("a single-step node has no step")
            return
        if self.start >= 0:
            raise ValueError(f"start must be negative (counted back from the newest step), got {self.start}")
        if self.stop is not None and not self.start < self.stop <= 0:
            raise ValueError(f"stop must be None or in ({self.start}, 0], got {self.stop}")
        if self.step is not None and self.step < 1:
            raise ValueError(f"step must be None or positive, got {self.step}")


@dataclasses.dataclass(frozen=True)
class ModuloEq:
    mod: int = 0
    eq: int = 0


@dataclasses.dataclass(frozen=True)
class ConditionProto:
    """A condition on the newest step: ``left`` compared by ``eq``, ``ge`` or ``mod_eq`` (``inverse`` negates)."""

    step_index: bool = False
    steps_since_applied: bool = False
    is_end_episode: bool = False
    flat_source_index: int | None = None
    eq: int | None = None
    ge: int | None = None
    mod_eq: ModuloEq | None = None
    inverse: bool = False

    def left_value(self, state: ApplyState, flat_step: Sequence[Any]) -> int:
        if self.step_index:
            return state.step_index
        if self.steps_since_applied:
            return state.steps_since_applied
        if self.is_end_episode:
            return int(state.end_of_episode)
        if self.flat_source_index is not None:
            value = flat_step[self.flat_source_index]
            if value is None:
                raise ValueError(f"condition on field {self.flat_source_index}, which has no value in this step")
            array = np.asarray(value)
            if array.shape != () or not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
                raise ValueError(f"condition on field {self.flat_source_index} needs an integer or bool scalar, "
                                 f"got {array.dtype}{array.shape}")
            return int(array)
        raise ValueError("condition has no left-hand side")

    def holds(self, state: ApplyState, flat_step: Sequence[Any]) -> bool:
        left = self.left_value(state, flat_step)
        if self.mod_eq is not None:
            result = left % self.mod_eq.mod == self.mod_eq.eq
        elif self.ge is not None:
            result = left >= self.ge
        elif self.eq is not None:
            result = left == self.eq
        else:
            raise ValueError("condition has no comparison (use ==, !=, >, >=, <, <= or % n ==)")
        return result != self.inverse

    def validate(self, num_fields: int) -> None:
        lefts = sum([self.step_index, self.steps_since_applied, self.is_end_episode,
                     self.flat_source_index is not None])
        if lefts != 1:
            raise ValueError(f"a condition needs exactly one left-hand side, got {lefts}")
        if self.flat_source_index is not None and not 0 <= self.flat_source_index < num_fields:
            raise ValueError(f"condition on field {self.flat_source_index} of a step with {num_fields} fields")
        if self.mod_eq is not None and self.mod_eq.mod < 1:
            raise ValueError(f"modulo must be positive, got {self.mod_eq.mod}")
        if sum(x is not None for x in (self.eq, self.ge, self.mod_eq)) != 1:
            raise ValueError("a condition needs exactly one comparison")


@dataclasses.dataclass(frozen=True)
class ConstantPriorityFn:
    value: float = 1.0


@dataclasses.dataclass(frozen=True)
class TDError:
    """``max_priority_weight * max|td| + (1 - max_priority_weight) * mean|td|`` over the item's steps of a field."""

    max_priority_weight: float = 0.0
    flat_source_index: int = 0


@dataclasses.dataclass(frozen=True)
class Priority:
    """How a config's items get their priority: exactly one of ``constant_fn`` and ``td_error``."""

    constant_fn: ConstantPriorityFn | None = None
    td_error: TDError | None = None

    def HasField(self, name: str) -> bool:  # noqa: N802 - Reverb code calls the proto method
        return getattr(self, name) is not None

    def WhichOneof(self, name: str) -> str | None:  # noqa: N802 - Reverb code calls the proto method
        if name != "priority_fn":
            raise ValueError(f"Priority has no oneof {name!r}")
        return "constant_fn" if self.constant_fn is not None else "td_error" if self.td_error is not None else None

    def validate(self, pattern_sources: set[int]) -> None:
        """Check the function; a TD error must come from a field the pattern takes."""
        if (self.constant_fn is None) == (self.td_error is None):
            raise ValueError("a priority needs exactly one of constant_fn and td_error")
        if self.constant_fn is not None:
            value = self.constant_fn.value
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"a constant priority must be a finite number >= 0, got {value}")
            return
        weight = self.td_error.max_priority_weight
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"max_priority_weight must be in [0, 1], got {weight}")
        if self.td_error.flat_source_index not in pattern_sources:
            raise ValueError(f"td_error is computed from field {self.td_error.flat_source_index} of the step, which "
                             f"the pattern does not take (it takes fields {sorted(pattern_sources)})")

    def of(self, flat: Sequence[PatternNode], columns: Sequence[Any]) -> float:
        """The priority of an item made of ``columns`` (TrajectoryColumns, one per node of ``flat``)."""
        if self.constant_fn is not None:
            return float(self.constant_fn.value)
        td = self.td_error
        for node, column in zip(flat, columns, strict=True):
            if node.flat_source_index == td.flat_source_index:
                errors = np.abs(np.asarray(column.numpy(), dtype=np.float64))
                if not errors.size:
                    return 0.0
                return float(td.max_priority_weight * errors.max() + (1.0 - td.max_priority_weight) * errors.mean())
        raise ValueError(f"td_error field {td.flat_source_index} is not in the pattern")


def constant_priority_fn(value: float) -> Priority:
    """A priority function that always returns ``value``."""
    return Priority(constant_fn=ConstantPriorityFn(value=float(value)))


def td_error(max_priority_weight: float, step_structure: Any,
             get_field_from_step_fn: Callable[[Any], Any]) -> Priority:
    """A priority function: the item's TD error (R2D2's mix of the max and the mean of a per-step field).

    ``get_field_from_step_fn`` picks the field holding the per-step TD error from
    a step structure; the pattern must take that field (once).
    """
    n = len(nest.flatten_with_paths(step_structure, none_is_leaf=True))
    index = get_field_from_step_fn(_pack_none_leaves(step_structure, iter(range(n))))
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
        raise ValueError(f"get_field_from_step_fn must pick one field of the step, got {index!r}")
    return Priority(td_error=TDError(max_priority_weight=float(max_priority_weight), flat_source_index=int(index)))


@dataclasses.dataclass(frozen=True)
class Config:
    """Insert ``flat`` (unflattened by ``pattern_structure``) into ``table`` when every condition holds."""

    flat: tuple[PatternNode, ...]
    pattern_structure: Any  # the pattern's structure (a gear.v1.Structure; None: a flat list of nodes)
    table: str
    priority: Priority = dataclasses.field(default_factory=lambda: constant_priority_fn(1.0))
    conditions: tuple[ConditionProto, ...] = ()

    def HasField(self, name: str) -> bool:  # noqa: N802 - Reverb code calls the proto method
        return getattr(self, name) is not None


Pattern = Any
ReferenceStep = Any


class _RefNode:
    """A leaf of a reference step: indexing it makes a PatternNode."""

    def __init__(self, index: int):
        self._index = index

    def __getitem__(self, key: int | slice) -> PatternNode:
        if isinstance(key, (int, np.integer)):
            return PatternNode(self._index, None, int(key), None)
        if isinstance(key, slice):
            return PatternNode(self._index, key.start, key.stop, key.step)
        raise ValueError(f"Key must be int or slice by got {key} (type {type(key)}).")


def create_reference_step(step_structure: Any) -> ReferenceStep:
    """The step structure with each leaf (None counts) replaced by an indexable reference."""
    paths = nest.flatten_with_paths(step_structure, none_is_leaf=True)
    refs = [_RefNode(i) for i in range(len(paths))]
    return _pack_none_leaves(step_structure, iter(refs))


def _pack_none_leaves(structure: Any, leaves: Any) -> Any:
    if structure is None or not nest.is_nested(structure):
        return next(leaves)
    if isinstance(structure, dict):
        return {k: _pack_none_leaves(structure[k], leaves) for k in sorted(structure)}
    if nest.is_namedtuple(structure):
        return type(structure)(*[_pack_none_leaves(v, leaves) for v in structure])
    return type(structure)(_pack_none_leaves(v, leaves) for v in structure)


def pattern_from_transform(step_structure: Any, transform: Callable[[ReferenceStep], Pattern]) -> Pattern:
    """The pattern ``transform`` builds from a reference step of ``step_structure``."""
    return transform(create_reference_step(step_structure))


def create_config(pattern: Pattern, table: str, conditions: Sequence[ConditionProto] = (),
                  priority: Priority | None = None) -> Config:
    """A config inserting ``pattern`` into ``table`` whenever all ``conditions`` hold (priority 1.0 by default)."""
    flat = nest.flatten(pattern)
    if not flat:
        raise ValueError("a pattern needs at least one node")
    for node in flat:
        if not isinstance(node, PatternNode):
            raise TypeError(f"pattern leaves must be PatternNodes (from a reference step), got {type(node)}")
        node.validate()
    for condition in conditions:
        if not isinstance(condition, ConditionProto):
            raise TypeError(f"conditions must be built with Condition, got {type(condition)}")
    if priority is None:
        priority = constant_priority_fn(1.0)
    if not isinstance(priority, Priority):
        raise TypeError(f"priority must be made with constant_priority_fn or td_error, got {type(priority)}")
    priority.validate({node.flat_source_index for node in flat})
    structure = nest.structure_of(pattern)
    return Config(flat=tuple(flat), pattern_structure=structure, table=table, priority=priority,
                  conditions=tuple(conditions))


def unpack_pattern(config: Config) -> Pattern:
    """The pattern of a config, with its structure."""
    if config.pattern_structure is None:
        return list(config.flat)
    return nest.unflatten(config.pattern_structure, list(config.flat))


def infer_signature(configs: Sequence[Config], step_spec: Any) -> Any:
    """The table signature of the items ``configs`` produce from steps like ``step_spec``.

    Its leaves are tf.TensorSpecs where the program uses TensorFlow (as Reverb's), else gear's TensorSpecs.

    Raises:
      ValueError: no configs, configs of different pattern structures or tables, or configs whose items
        would differ in dtype or in shape (other than the leading dimension) at some path.
    """
    if not configs:
        raise ValueError("At least one config must be provided.")
    if any(c.pattern_structure != configs[0].pattern_structure for c in configs):
        raise ValueError("All configs must have exactly the same pattern_structure.")
    if any(c.table != configs[0].table for c in configs):
        raise ValueError(f"All configs must target the same table but provided configs included "
                         f"{', '.join(sorted({c.table for c in configs}))}.")
    flat_step_spec = [to_tensor_spec(s) for s in nest.flatten(step_spec)]
    flat_patterns = [c.flat for c in configs]
    paths = [p for p, _ in nest.flatten_with_paths(unpack_pattern(configs[0]))]
    specs = []
    for i, nodes in enumerate(zip(*flat_patterns, strict=True)):
        path = paths[i] if i < len(paths) else (i,)
        dtypes = [flat_step_spec[n.flat_source_index].dtype for n in nodes]
        if any(d != dtypes[0] for d in dtypes):
            raise ValueError(f"Configs produce trajectories with multiple dtypes at {path}. Got {dtypes}.")
        shapes = []
        for n in nodes:
            shape = tuple(flat_step_spec[n.flat_source_index].shape)
            if n.is_slice:
                stop = 0 if n.stop is None else n.stop
                shape = (len(range(n.start, stop, n.step or 1)), *shape)
            shapes.append(shape)
        if any(len(s) != len(shapes[0]) for s in shapes) or (
                len(shapes[0]) > 1 and any(s[1:] != shapes[0][1:] for s in shapes)):
            raise ValueError(f"Configs produce trajectories with incompatible shapes at {path}. Got {shapes}.")
        merged = shapes[0] if all(s == shapes[0] for s in shapes) else (None, *shapes[0][1:])
        specs.append(TensorSpec(merged, dtypes[0], "/".join(str(x) for x in path)))
    if configs[0].pattern_structure is None:
        return as_program_specs(specs)
    return as_program_specs(nest.unflatten(configs[0].pattern_structure, specs))


class _ConditionBuilder:
    """Builds a condition with comparison operators (``step_index() % 2 == 0``)."""

    def __init__(self, incomplete: ConditionProto):
        self._incomplete = incomplete

    def __mod__(self, cmp: int) -> _ConditionBuilder:
        return _ConditionBuilder(dataclasses.replace(self._incomplete, mod_eq=ModuloEq(mod=int(cmp))))

    def __eq__(self, cmp: int) -> ConditionProto:  # type: ignore[override]
        c = self._incomplete
        if c.mod_eq is not None:
            return dataclasses.replace(c, mod_eq=ModuloEq(mod=c.mod_eq.mod, eq=int(cmp)))
        return dataclasses.replace(c, eq=int(cmp))

    def __ne__(self, cmp: int) -> ConditionProto:  # type: ignore[override]
        return dataclasses.replace(self == cmp, inverse=True)

    def __ge__(self, cmp: int) -> ConditionProto:
        return dataclasses.replace(self._incomplete, ge=int(cmp))

    def __gt__(self, cmp: int) -> ConditionProto:
        return self >= cmp + 1

    def __lt__(self, cmp: int) -> ConditionProto:
        return dataclasses.replace(self >= cmp, inverse=True)

    def __le__(self, cmp: int) -> ConditionProto:
        return dataclasses.replace(self > cmp, inverse=True)

    __hash__ = None  # type: ignore[assignment]


class Condition:
    """Building blocks of conditions."""

    @staticmethod
    def step_index() -> _ConditionBuilder:
        """(Zero) index of the most recent appended step within the episode."""
        return _ConditionBuilder(ConditionProto(step_index=True))

    @staticmethod
    def steps_since_applied() -> _ConditionBuilder:
        """Number of steps appended since this config last created an item."""
        return _ConditionBuilder(ConditionProto(steps_since_applied=True))

    @staticmethod
    def is_end_episode() -> ConditionProto:
        """True only while ``end_episode`` is called on the writer."""
        return ConditionProto(is_end_episode=True, eq=1)

    @staticmethod
    def data(step_structure: Any) -> Any:
        """Conditions on the value of a scalar integer or bool field of the newest step."""
        n = len(nest.flatten_with_paths(step_structure, none_is_leaf=True))
        return _pack_none_leaves(step_structure,
                                 iter([_ConditionBuilder(ConditionProto(flat_source_index=i)) for i in range(n)]))


@dataclasses.dataclass
class ApplyState:
    """What conditions look at, per config: the newest step's index, steps since its last item, episode end."""

    step_index: int = -1
    steps_since_applied: int = 0
    end_of_episode: bool = False


def items_to_create(configs: Sequence[Config], states: Sequence[ApplyState], history: Sequence[Any],
                    newest: Sequence[Any], end_of_episode: bool) -> list[tuple[Config, list[Any]]]:
    """The items the configs make after the newest step: (config, one column per node of its pattern).

    ``history[i]`` is field i's recent steps, indexed as Reverb's patterns index
    them (``[-1]``, ``[-3:]``; ValueError where a referenced step has no value);
    ``newest`` the newest step's flat values (for data conditions). A config
    applies when all its conditions hold and its pattern has enough history; at
    the end of an episode only configs conditioned on it apply. Each applied
    config's ``steps_since_applied`` is reset.
    """
    made = []
    for config, state in zip(configs, states, strict=True):
        state.end_of_episode = end_of_episode
        if end_of_episode and not any(c.is_end_episode for c in config.conditions):
            continue
        if not all(c.holds(state, newest) for c in config.conditions):
            continue
        columns = []
        for node in config.flat:
            field = history[node.flat_source_index]
            if node.history_needed() > len(field):
                break
            try:
                columns.append(field[node.start:node.stop:node.step] if node.is_slice else field[node.stop])
            except ValueError:  # a referenced step has no value for this field
                break
        else:
            made.append((config, columns))
            state.steps_since_applied = 0
    return made
