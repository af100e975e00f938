"""Reverb's ``reverb.structured_writer``: a writer that inserts the items its configs describe.

``StructuredWriter.append`` stores one step (or part of one, with
``partial_step``) on a TrajectoryWriter, then applies every config whose
conditions hold and whose pattern has enough history: one item per config
and step, with the config's priority (a constant, or the TD error of a
field). ``end_episode`` finishes an open partial step (as Reverb does),
applies the configs conditioned on the end of the episode, and flushes.
The module also exports Reverb's config helpers (gear_client/writers/structured_config.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from gear_client.writers.column_buffer import ColumnMismatchError
from gear_client.writers.structured_config import (
    ApplyState,
    Condition,
    ConditionProto,
    Config,
    Pattern,
    PatternNode,
    Priority,
    ReferenceStep,
    constant_priority_fn,
    create_config,
    create_reference_step,
    infer_signature,
    items_to_create,
    pattern_from_transform,
    td_error,
    unpack_pattern,
)
from gear_client.writers.trajectory_writer import TrajectoryWriter
from gear_contract import nest, specs

__all__ = [
    "Condition",
    "ConditionProto",
    "Config",
    "Pattern",
    "PatternNode",
    "Priority",
    "ReferenceStep",
    "StructuredWriter",
    "constant_priority_fn",
    "create_config",
    "create_reference_step",
    "infer_signature",
    "pattern_from_transform",
    "td_error",
    "unpack_pattern",
]


class StructuredWriter:
    """Appends steps and inserts the items its configs describe (``client.structured_writer(configs)``)."""

    def __init__(self, client: Any, configs: Sequence[Config]):
        """A writer of ``client`` applying ``configs`` after every step.

        Args:
          client: the Client whose daemon receives the items.
          configs: configs made with ``create_config``, at least one.

        Raises:
          ValueError: ``configs`` is empty, or a config's pattern or priority is invalid.
          TypeError: a config was not made with ``create_config``.
        """
        if not configs:
            raise ValueError("At least one config must be provided.")
        for config in configs:
            if not isinstance(config, Config):
                raise TypeError(f"configs must be made with create_config, got {type(config)}")
            for node in config.flat:
                node.validate()
            config.priority.validate({node.flat_source_index for node in config.flat})
        self._configs = [copy.copy(c) for c in configs]
        keep = max(node.history_needed() for c in configs for node in c.flat)
        self._writer = TrajectoryWriter(client, max(1, keep))
        self._flat_data_length: int | None = None
        self._flat_paths: list[tuple] = []  # each flattened field's path in the appended data (for errors)
        self._states = [ApplyState() for _ in configs]
        self._step_index = -1
        self._last_flat: list[Any] = []
        self._step_open = False

    def __enter__(self) -> StructuredWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self._writer.close()

    @property
    def step_is_open(self) -> bool:
        """True if ``partial_step`` was set in the most recent ``append``."""
        return self._step_open

    def append(self, data: Any, *, partial_step: bool = False) -> None:
        """Append a step (same flattened length every time; None leaves allowed), then apply the configs.

        Args:
          data: a nest of arrays, scalars or None (a field without a value at this step).
          partial_step: leave the step open: the next ``append`` fills in more of its fields, and the
            configs apply once the step is complete.

        Raises:
          ValueError: the step's flattened length differs from the first step's, a field's dtype or shape
            differs from its first value's (Reverb's messages, naming the field's index and path), a config
            references a field the step does not have, or an item does not fit its table (as ``create_item``).
          RuntimeError: the writer is closed.
        """
        pairs = nest.flatten_with_paths(data, none_is_leaf=True)
        if self._flat_data_length is None:
            self._flat_paths = [path for path, _ in pairs]
        self._append_flat([leaf for _, leaf in pairs], partial_step)

    def _append_flat(self, flat: list[Any], partial_step: bool) -> None:
        if self._flat_data_length is None:
            self._flat_data_length = len(flat)
            for config in self._configs:
                for node in config.flat:
                    if node.flat_source_index >= len(flat):
                        raise ValueError(f"config for table '{config.table}' references field "
                                         f"{node.flat_source_index} of a step with {len(flat)} fields")
                for condition in config.conditions:
                    condition.validate(len(flat))
        if len(flat) != self._flat_data_length:
            raise ValueError(f"Flattened data has an unexpected length, got {len(flat)} but wanted "
                             f"{self._flat_data_length}.")
        if not self._step_open:
            self._step_index += 1
            self._last_flat = flat
        else:
            self._last_flat = [new if new is not None else old for new, old in zip(flat, self._last_flat,
                                                                                    strict=True)]
        try:
            self._writer.append(tuple(flat), partial_step=partial_step)
        except ColumnMismatchError as e:
            raise self._mismatch(e) from e
        self._step_open = partial_step
        if not partial_step:
            for state in self._states:
                state.step_index = self._step_index
                state.steps_since_applied += 1
            self._apply(end_of_episode=False)

    def _mismatch(self, error: ColumnMismatchError) -> ValueError:
        """Reverb's error for a field whose dtype or shape changed: its flat index and its path in the data."""
        index = error.path[0]
        path = self._flat_paths[index] if index < len(self._flat_paths) else (index,)
        where = f"column {index} (path={path})"
        if error.dtype != error.expected_dtype:
            return ValueError(f"Tensor of wrong dtype provided for {where}. Got {specs.kernel_dtype_name(error.dtype)} "
                              f"but expected {specs.kernel_dtype_name(error.expected_dtype)}.")
        return ValueError(f"Tensor of incompatible shape provided for {where}. Got "
                          f"{specs.kernel_shape_text(error.shape)} which is incompatible with "
                          f"{specs.kernel_shape_text(error.expected_shape)}.")

    def _apply(self, end_of_episode: bool) -> None:
        if self._step_index < 0:
            return
        for config, columns in items_to_create(self._configs, self._states, self._writer.history, self._last_flat,
                                               end_of_episode):
            trajectory = (nest.unflatten(config.pattern_structure, columns)
                          if config.pattern_structure is not None else columns)
            self._writer.create_item(config.table, config.priority.of(config.flat, columns), trajectory)

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Block until all but ``block_until_num_items`` items are confirmed by the server.

        Args:
          block_until_num_items: how many items may stay unacknowledged.
          timeout_ms: the most milliseconds to wait (None or negative: no limit).

        Raises:
          DeadlineExceededError: the items were not acknowledged within ``timeout_ms``.
          ItemsNotInsertedError: items were given up (the daemon stayed away past the reconnect timeout).
          RuntimeError: the writer is closed.
        """
        self._writer.flush(block_until_num_items, timeout_ms)

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Finish an open partial step, apply the end-of-episode configs, flush, and start a new episode.

        The episode is reset even when the flush times out (DeadlineExceededError).

        Args:
          clear_buffers: forget the appended steps.
          timeout_ms: the most milliseconds the flush waits (None: no limit).

        Raises:
          DeadlineExceededError: the flush did not complete within ``timeout_ms``.
          ItemsNotInsertedError: items were given up (the daemon stayed away past the reconnect timeout).
        """
        if self._step_open:
            self._append_flat([None] * (self._flat_data_length or 0), partial_step=False)
        self._apply(end_of_episode=True)
        try:
            self._writer.end_episode(clear_buffers, timeout_ms)
        finally:
            self._step_index = -1
            for state in self._states:
                state.step_index = -1
                state.steps_since_applied = 0
                state.end_of_episode = False

    def close(self) -> None:
        """End the stream (items not yet acknowledged may be lost; ``flush`` first to keep them)."""
        self._writer.close()
