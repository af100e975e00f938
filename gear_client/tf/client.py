"""Reverb's ``TFClient``: sample, insert, update priorities and datasets as TensorFlow ops (TensorFlow is optional).

Each op runs gear's Python client (gear_client.client.Client) through
``tf.numpy_function``, so it works eagerly and inside ``tf.function`` graphs.
Arguments are checked as Reverb checks them (ValueError for a bad dtype or
rank). ``dataset`` is Reverb's deprecated alias of ``ReplayDataset``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from gear_client.client import Client
from gear_client.replay_sample import ReplaySample, SampleInfo
from gear_client.tf.datasets import ReplayDataset, sample_info_specs
from gear_contract import nest

__all__ = ["TFClient"]


class TFClient:
    """Client of a gear daemon whose calls are TensorFlow ops (Reverb's ``reverb.TFClient``)."""

    def __init__(self, server_address: str, shared_name: str | None = None, name: str = "reverb"):
        del shared_name  # one Python client per TFClient; sessions are not shared across graphs here
        self._name = name
        self._server_address = server_address
        self._client = Client(server_address)

    def sample(self, table: str, data_dtypes: Any, name: str | None = None) -> ReplaySample:
        """One item of ``table``: ReplaySample(info of scalars, data as ``data_dtypes`` of the item's leaves)."""
        flat_dtypes = [tf.as_dtype(d) for d in nest.flatten(data_dtypes)]
        info_dtypes = [spec.dtype for spec in sample_info_specs()]

        def sample_one() -> list[np.ndarray]:
            sample = next(self._client.sample(table, num_samples=1, emit_timesteps=False))
            leaves = nest.flatten(sample.data)
            if len(leaves) != len(flat_dtypes):
                raise ValueError(f"table {table!r}: the item has {len(leaves)} leaves, data_dtypes "
                                 f"{len(flat_dtypes)}")
            info = [np.asarray(v, d.as_numpy_dtype) for v, d in zip(sample.info, info_dtypes, strict=True)]
            data = [np.asarray(v).astype(d.as_numpy_dtype, copy=False) for v, d in zip(leaves, flat_dtypes,
                                                                                       strict=True)]
            return info + data

        with tf.name_scope(name or f"{self._name}_sample"):
            out = tf.numpy_function(sample_one, [], info_dtypes + flat_dtypes, stateful=True)
        info = SampleInfo(*(tf.ensure_shape(t, []) for t in out[:len(info_dtypes)]))
        return ReplaySample(info, nest.pack_as(data_dtypes, out[len(info_dtypes):]))

    def insert(self, data: Sequence[Any], tables: Any, priorities: Any, name: str | None = None) -> Any:
        """Insert ``data`` (one step) as an item into each of ``tables`` (string, rank 1) with ``priorities``
        (float64, rank 1, zipped with ``tables``)."""
        tables = tf.convert_to_tensor(tables)
        priorities = tf.convert_to_tensor(priorities)
        if tables.dtype != tf.string or tables.shape.rank != 1:
            raise ValueError("tables must be a string tensor of rank 1")
        if priorities.dtype != tf.float64 or priorities.shape.rank != 1:
            raise ValueError("priorities must be a float64 tensor of rank 1")
        if not tables.shape.is_compatible_with(priorities.shape):
            raise ValueError("priorities and tables must have the same shape")
        leaves = [tf.convert_to_tensor(x) for x in nest.flatten(data)]

        def insert_one(names: np.ndarray, values: np.ndarray, *arrays: np.ndarray) -> np.ndarray:
            if len(names) != len(values):
                raise ValueError("priorities and tables must have the same shape")
            self._client.insert(list(arrays), {n.decode(): float(p) for n, p in zip(names, values, strict=True)})
            return np.zeros((), np.bool_)

        with tf.name_scope(name or f"{self._name}_insert"):
            return tf.numpy_function(insert_one, [tables, priorities, *leaves], tf.bool, stateful=True)

    def update_priorities(self, table: str, keys: Any, priorities: Any, keys_to_delete: Any = None,
                          name: str | None = None) -> Any:
        """Set ``priorities`` of ``keys`` (unknown keys are ignored) and delete ``keys_to_delete``."""
        keys = tf.convert_to_tensor(keys, tf.uint64)
        priorities = tf.convert_to_tensor(priorities, tf.float64)
        if keys_to_delete is None:
            keys_to_delete = tf.constant([], dtype=tf.uint64)
        keys_to_delete = tf.convert_to_tensor(keys_to_delete, tf.uint64)

        def update(k: np.ndarray, p: np.ndarray, d: np.ndarray) -> np.ndarray:
            if k.shape != p.shape:
                raise ValueError(f"keys ({k.shape}) and priorities ({p.shape}) must have the same shape")
            self._client.mutate_priorities(table, updates=dict(zip(k.tolist(), p.tolist(), strict=True)),
                                           deletes=d.tolist())
            return np.zeros((), np.bool_)

        with tf.name_scope(name or f"{self._name}_update_priorities"):
            return tf.numpy_function(update, [keys, priorities, keys_to_delete], tf.bool, stateful=True)

    def dataset(self, table: str, dtypes: Any, shapes: Any, capacity: int = 100, num_workers_per_iterator: int = -1,
                max_samples_per_stream: int = -1, sequence_length: int | None = None, emit_timesteps: bool = True,
                rate_limiter_timeout_ms: int = -1) -> tf.data.Dataset:
        """Reverb's deprecated ``TFClient.dataset``: a ReplayDataset with ``capacity`` items in flight."""
        return ReplayDataset(self._server_address, table, dtypes=dtypes, shapes=shapes,
                             max_in_flight_samples_per_worker=capacity,
                             num_workers_per_iterator=num_workers_per_iterator,
                             max_samples_per_stream=max_samples_per_stream, sequence_length=sequence_length,
                             emit_timesteps=emit_timesteps, rate_limiter_timeout_ms=rate_limiter_timeout_ms)
