"""Reverb's ``reverb.pattern_dataset``: structured-writer patterns applied to a dataset of steps, in tf.data.

``PatternDataset(input_dataset, configs, respect_episode_boundaries,
is_end_of_episode)`` yields the trajectories a StructuredWriter with ``configs``
would insert if the steps of ``input_dataset`` were appended to it, without a
server: the same configs, conditions and history rules
(structured_config.items_to_create). As Reverb's, it runs in eager mode
(TF2); its element spec is ``structured_writer.infer_signature(configs,
input_dataset.element_spec)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from gear_client.replay_sample import ReplaySample, SampleInfo
from gear_client.tf.datasets import GeneratedDataset, sample_info_specs
from gear_client.writers.structured_config import ApplyState, Config, infer_signature, items_to_create
from gear_contract import nest

__all__ = ["PatternDataset", "pattern_dataset_with_info"]


class _FieldHistory:
    """One field's most recent step values, indexed as a pattern node indexes them (``[-1]``, ``[-3:]``)."""

    def __init__(self, keep: int):
        self._values: deque = deque(maxlen=keep)

    def append(self, value: Any) -> None:
        self._values.append(value)

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, key: int | slice) -> np.ndarray:
        picked = list(self._values)[key]
        if isinstance(key, slice):
            if any(v is None for v in picked):
                raise ValueError("a step in the slice has no value for this field")
            return np.stack(picked)
        if picked is None:
            raise ValueError("the step has no value for this field")
        return picked


def _check_is_end_of_episode(is_end_of_episode: Callable[[Any], Any], element_spec: Any) -> None:
    """ValueError (Reverb's words) unless ``is_end_of_episode`` gives a scalar bool for a step of ``element_spec``."""
    traced = tf.function(lambda step: tf.convert_to_tensor(is_end_of_episode(step)))
    output = traced.get_concrete_function(element_spec).structured_outputs
    spec = tf.TensorSpec.from_tensor(output)
    if not spec.is_compatible_with(tf.TensorSpec([], tf.bool)):
        raise ValueError(f"Invalid `is_end_of_episode`. `is_end_of_episode` must return `bool`, but its return type "
                         f"is {spec}.")


class PatternDataset(GeneratedDataset):
    """A tf.data.Dataset of the trajectories ``configs`` make from the steps of ``input_dataset`` (see module)."""

    def __init__(self, input_dataset: tf.data.Dataset, configs: Sequence[Config], respect_episode_boundaries: bool,
                 is_end_of_episode: Callable[[Any], bool]):
        """Args:
          input_dataset: a dataset of single steps (flatten a dataset of episodes first).
          configs: structured-writer configs (``structured_writer.create_config``).
          respect_episode_boundaries: if True, no trajectory spans two episodes.
          is_end_of_episode: a step -> whether it is the last of its episode (a scalar bool).

        Raises:
          ValueError: ``configs`` do not make items of one signature, or ``is_end_of_episode`` does not
            return a scalar bool.
        """
        signature = infer_signature(configs, input_dataset.element_spec)
        _check_is_end_of_episode(is_end_of_episode, input_dataset.element_spec)
        configs = list(configs)
        keep = max(node.history_needed() for config in configs for node in config.flat)

        def generate() -> Iterator[Any]:
            fields: list[_FieldHistory] = []
            states = [ApplyState() for _ in configs]
            step_index = -1
            for step in input_dataset:
                flat = [np.asarray(leaf) for leaf in nest.flatten(step)]
                if not fields:
                    fields = [_FieldHistory(keep) for _ in flat]
                for history, value in zip(fields, flat, strict=True):
                    history.append(value)
                step_index += 1
                for state in states:
                    state.step_index = step_index
                    state.steps_since_applied += 1
                made = items_to_create(configs, states, fields, flat, end_of_episode=False)
                end = bool(np.asarray(is_end_of_episode(step)))
                if end:
                    made += items_to_create(configs, states, fields, flat, end_of_episode=True)
                for config, columns in made:
                    yield (nest.unflatten(config.pattern_structure, columns)
                           if config.pattern_structure is not None else columns)
                if end:  # a new episode: step indices restart, and the history too where episodes are respected
                    step_index = -1
                    for state in states:
                        state.step_index, state.steps_since_applied, state.end_of_episode = -1, 0, False
                    if respect_episode_boundaries:
                        for history in fields:
                            history.clear()

        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        super().__init__(tf.data.Dataset.from_generator(generate, output_signature=signature).with_options(options))


def pattern_dataset_with_info(input_dataset: tf.data.Dataset, configs: Sequence[Config],
                              respect_episode_boundaries: bool,
                              is_end_of_episode: Callable[[Any], bool]) -> tf.data.Dataset:
    """The PatternDataset's trajectories as ``ReplaySample``s whose info is zeros (Reverb's helper).

    Raises:
      ValueError: as PatternDataset.
    """
    dataset = PatternDataset(input_dataset, configs, respect_episode_boundaries, is_end_of_episode)
    zeros = SampleInfo(*(tf.zeros([], spec.dtype) for spec in sample_info_specs()))
    return dataset.map(lambda data: ReplaySample(info=zeros, data=data))
