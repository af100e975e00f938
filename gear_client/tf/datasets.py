"""Reverb's tf.data datasets on gear, for learners written against TensorFlow (TensorFlow is optional).

``TrajectoryDataset``, ``TimestepDataset`` and ``ReplayDataset`` build a
``tf.data.Dataset`` whose elements are ``ReplaySample(info, data)`` with
Reverb's specs: ``info`` a SampleInfo of scalars (key uint64, probability
float64, table_size int64, priority float64, times_sampled int32) and ``data``
the nest of ``dtypes``/``shapes`` (or of the table signature, with
``from_table_signature``). Like Reverb's, the datasets are unbatched: one
element per item (trajectories) or per step (timesteps); ``.batch()`` them.
Acme's ``make_reverb_dataset`` and TF-Agents' ``ReverbReplayBuffer.as_dataset``
build on exactly these calls. As Reverb's, the classes are ``tf.data.Dataset``
subclasses (TF1's ``make_initializable_iterator`` included), and
``server_address`` and ``table`` may be constant string tensors.

The items come from gear's own Python dataset (gear_client.datasets, one item
per batch, prefetched in the background over the best data plane) through
``tf.data.Dataset.from_generator``: each iterator of the tf.data pipeline opens
its own session and closes it when the iterator is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

try:
    import tensorflow as tf
except ImportError as e:  # pragma: no cover - the module is only imported where TensorFlow is wanted
    raise ImportError("gear_client.tf.datasets needs TensorFlow (pip install tensorflow-cpu); gear itself does "
                      "not: gear_client.TrajectoryDataset yields NumPy/CuPy/PyTorch batches without it") from e

from gear_client import datasets as python_datasets
from gear_client.data_planes.batch import SampledBatch
from gear_client.replay_sample import ReplaySample, SampleInfo
from gear_client.tf.specs import to_tf_signature
from gear_contract import nest, specs

__all__ = ["TrajectoryDataset", "TimestepDataset", "ReplayDataset", "GeneratedDataset", "sample_info_specs",
           "table_signature"]

def _as_text(value: Any, what: str) -> Any:
    """A Python string from a str, bytes or a constant string tensor (Reverb's datasets take either); a list
    of them stays a list (several daemons' addresses: one table over shards, docs/SHARDING.md)."""
    if isinstance(value, (list, tuple)):
        return [_as_text(v, what) for v in value]
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
        static = tf.get_static_value(value)
        if static is not None and np.ndim(static) == 0:
            static = static.item() if isinstance(static, np.ndarray) else static
            return static.decode() if isinstance(static, bytes) else str(static)
    raise TypeError(f"{what} must be a string or a constant string tensor, got {value!r}")


def sample_info_specs() -> SampleInfo:
    """Reverb's SampleInfo specs: scalars of (uint64, float64, int64, float64, int32)."""
    return SampleInfo(*(tf.TensorSpec([], tf.as_dtype(d)) for d in SampleInfo.tf_dtypes()))


def table_signature(server_address: str, table: str, timeout_s: float | None = None) -> Any:
    """The table's signature (a nest of tf.TensorSpec); ValueError when the table is unknown or has none."""
    from gear_client.client import Client

    client = Client(server_address)
    try:
        infos = client.server_info(timeout_s)
    finally:
        client.close()
    if table not in infos:
        raise ValueError(f"Server at {server_address} does not contain any table named {table}. Found: "
                         f"{', '.join(sorted(infos))}.")
    signature = infos[table].signature
    if signature is None:
        raise ValueError(f"Table {table} at {server_address} does not have a signature.")
    return to_tf_signature(signature)


def _specs_from(dtypes: Any, shapes: Any) -> Any:
    """tf.TensorSpec nest from Reverb's parallel ``dtypes`` and ``shapes`` nests (a shape is a leaf, even a list)."""
    if not nest.is_nested(dtypes):
        return tf.TensorSpec(shape=tf.TensorShape(shapes), dtype=tf.as_dtype(dtypes))
    if isinstance(dtypes, Mapping):
        if not isinstance(shapes, Mapping) or set(shapes) != set(dtypes):
            raise ValueError(f"shapes {shapes!r} do not have the structure of dtypes {dtypes!r}")
        return type(dtypes)((k, _specs_from(dtypes[k], shapes[k])) for k in dtypes)
    if not isinstance(shapes, (list, tuple)) or len(shapes) != len(dtypes):
        raise ValueError(f"shapes {shapes!r} do not have the structure of dtypes {dtypes!r}")
    children = [_specs_from(d, s) for d, s in zip(dtypes, shapes, strict=True)]
    return type(dtypes)(*children) if nest.is_namedtuple(dtypes) else type(dtypes)(children)


def _lists_as_tuples(spec: Any) -> Any:
    """The nest with lists made tuples: tf.data takes a list as one value, not a sequence (as Reverb does)."""
    if not nest.is_nested(spec):
        return spec
    if isinstance(spec, Mapping):
        return type(spec)((k, _lists_as_tuples(v)) for k, v in spec.items())
    children = [_lists_as_tuples(child) for child in spec]
    return type(spec)(*children) if nest.is_namedtuple(spec) else tuple(children)


# Seconds a generator waits for items before it hands tf.data an empty element (see _from_generator).
POLL_S = 0.1


class _ItemSource:
    """The table's items over gear's Python dataset: one at a time, or in batches where the table allows.

    Where sampling takes nothing from the table (data_planes.read_ahead), the
    Python dataset fetches ``max_in_flight`` items per batch; queues, tables of
    limited samples per item and rate-limited tables get one item per batch,
    fetched when asked for, so no item is taken that is not delivered. The
    requested specs are checked against the table's signature first (Reverb's
    errors, an InvalidArgumentError through tf.data).
    """

    def __init__(self, server_address: str, table: str, data_spec: Any, *, rate_limiter_timeout_ms: int,
                 max_samples: int, max_in_flight: int, per_step: bool = False):
        self.server_address = server_address
        self.table = table
        self.data_spec = _lists_as_tuples(data_spec)
        self.flat_specs: list[tf.TensorSpec] = nest.flatten(self.data_spec)
        self.rate_limiter_timeout_ms = int(rate_limiter_timeout_ms)
        self.max_samples = int(max_samples)
        self.max_in_flight = max(1, int(max_in_flight))
        self.per_step = per_step  # the specs are of one step of each item (timestep datasets)

    def _batch_size(self) -> int:
        """Items per fetch: ``max_in_flight`` where the table may be read ahead, else 1 (after the signature check)."""
        from gear_client.client import Client
        from gear_client.data_planes.read_ahead import may_read_ahead

        client = Client(self.server_address)
        try:
            info = client._table_info(self.table, refresh=True)
        finally:
            client.close()
        if info.HasField("signature"):
            self._check_signature(specs.signature_specs(info.signature))
        return self.max_in_flight if may_read_ahead(info) else 1

    def _check_signature(self, signature: list) -> None:
        """ValueError in Reverb's words when the requested specs cannot be the table signature's."""
        if len(signature) != len(self.flat_specs):
            raise ValueError(f"Inconsistent number of tensors requested from table '{self.table}'.  Requested "
                             f"{len(self.flat_specs)} tensors, but table signature shows {len(signature)} tensors.")
        for i, (want, have) in enumerate(zip(self.flat_specs, signature, strict=True)):
            have_shape = tf.TensorShape(list(have.shape))
            # A timestep dataset's step spec fits a step signature (Reverb's), or a trajectory signature of a
            # fixed number of steps with that leading dimension dropped.
            fits = want.shape.is_compatible_with(have_shape) or (
                self.per_step and have_shape.rank and have_shape[0] is not None
                and want.shape.is_compatible_with(have_shape[1:]))
            if tf.as_dtype(have.dtype) != want.dtype or not fits:
                raise ValueError(
                    f"Requested incompatible tensor at flattened index {i} from table '{self.table}'.  Requested "
                    f"(dtype, shape): {_dtype_and_shape(want.dtype, want.shape)}.  Signature "
                    f"(dtype, shape): {_dtype_and_shape(have.dtype, have_shape)}")

    def batches(self) -> Iterator[SampledBatch | None]:
        """The Python dataset's batches, each checked to hold as many leaves as the specs; None every POLL_S
        seconds without one (the generator then hands tf.data an empty element and gets its thread back)."""
        dataset = python_datasets.TrajectoryDataset(
            self.server_address, self.table, batch_size=self._batch_size(), prefetch=2,
            rate_limiter_timeout_ms=self.rate_limiter_timeout_ms, max_samples=self.max_samples)
        try:
            for batch in dataset.batches(poll_s=POLL_S):
                if batch is None:
                    yield None
                    continue
                if len(batch.columns) != len(self.flat_specs):
                    raise ValueError(f"table {self.table!r}: its items have {len(batch.columns)} leaves but the "
                                     f"dataset's specs have {len(self.flat_specs)}")
                yield batch
        finally:
            dataset.close()

    def items(self) -> Iterator[tuple[SampleInfo, list[np.ndarray]] | None]:
        """The items one by one; None where ``batches`` gave None."""
        for batch in self.batches():
            if batch is None:
                yield None
                continue
            for i, info in enumerate(batch.item_infos()):
                yield info, [np.asarray(leaf) for leaf in batch.item_columns(i)]


def _mismatch(spec: tf.TensorSpec, dtype: Any, shape: Any, table: str, what: str) -> ValueError:
    """Reverb's error for a tensor that does not fit the dataset's spec, with where it came from."""
    return ValueError(f"Specification has (dtype, shape): {_dtype_and_shape(spec.dtype, spec.shape)}.  Tensor has "
                      f"(dtype, shape): {_dtype_and_shape(dtype, shape)}. (table {table!r}, {what})")


def _dtype_and_shape(dtype: Any, shape: Any) -> str:
    """``(float, [3,3])``: a tensor's dtype and shape as Reverb's errors print them."""
    return f"({specs.kernel_dtype_name(dtype)}, {specs.kernel_shape_text(shape)})"


def _check_leaf(spec: tf.TensorSpec, value: np.ndarray, table: str, what: str, steps: bool = False) -> np.ndarray:
    """The leaf as the spec's dtype; ValueError naming the table when the shape cannot match.

    ``steps``: ``value`` holds steps of ``spec`` (a leading time dimension); errors show one step's shape.
    """
    shape = value.shape[1:] if steps else value.shape
    if (steps and value.ndim == 0) or not spec.shape.is_compatible_with(shape):
        raise _mismatch(spec, value.dtype, shape, table, what)
    want = spec.dtype.as_numpy_dtype
    return value if value.dtype == want else value.astype(want)


def _from_generator(generate, element_spec: Any) -> tf.data.Dataset:
    """The generator of outer-dimension elements as a tf.data.Dataset of their rows (``unbatch``).

    Each generator element stacks rows (items, or an item's steps) on a leading
    dimension; while nothing comes it hands over an element of zero rows every
    POLL_S seconds. A generator that waited inside its call would hold one of
    tf.data's threads: with several readers on a table of limited samples
    (``max_times_sampled``, a queue), readers waiting for samples that will
    never come kept the rows other readers had already taken from reaching the
    batch (TF-Agents' ``as_dataset(num_parallel_calls=3)`` stopped one batch
    short). Without the prefetch tf.data injects by default: with it,
    ``next(iter(dataset))`` on a queue holding one item waited for a second
    item before it handed over the first; gear's dataset prefetches already.
    """
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    outer = nest.map_structure(_outer, element_spec)
    return tf.data.Dataset.from_generator(generate, output_signature=outer).with_options(options).unbatch()


def _outer(spec: tf.TensorSpec) -> tf.TensorSpec:
    """The spec with a leading dimension of unknown size (a batch, or an item's steps)."""
    shape = tf.TensorShape(None) if spec.shape.rank is None else tf.TensorShape([None]).concatenate(spec.shape)
    return tf.TensorSpec(shape, spec.dtype, spec.name)


def _no_rows(element_spec: Any) -> Any:
    """An element of zero rows for ``element_spec`` (one row's specs): what a generator yields while waiting."""
    def empty(spec: tf.TensorSpec) -> np.ndarray:
        dims = [0] if spec.shape.rank is None else [0, *(d or 0 for d in spec.shape.as_list())]
        return np.zeros(dims, spec.dtype.as_numpy_dtype)

    return nest.map_structure(empty, element_spec)


def _trajectories(source: _ItemSource, sequence_length: int | None = None) -> tf.data.Dataset:
    element_spec = ReplaySample(sample_info_specs(), source.data_spec)
    if sequence_length is None and all(spec.shape.is_fully_defined() for spec in source.flat_specs):
        return _whole_batches(source, element_spec)
    waiting = _no_rows(element_spec)

    def generate() -> Iterator[ReplaySample]:
        for item in source.items():
            if item is None:
                yield waiting
                continue
            info, leaves = item
            if sequence_length is not None:
                for leaf in leaves:
                    if leaf.ndim == 0 or leaf.shape[0] != sequence_length:
                        raise ValueError(f"table {source.table!r}: item {info.key} has "
                                         f"{leaf.shape[0] if leaf.ndim else 'no'} steps, sequence_length is "
                                         f"{sequence_length}")
            data = [_check_leaf(s, v, source.table, f"item {info.key}")[np.newaxis]
                    for s, v in zip(source.flat_specs, leaves, strict=True)]
            infos = SampleInfo(*(np.asarray([v], spec.dtype.as_numpy_dtype)
                                 for v, spec in zip(info, element_spec.info, strict=True)))
            yield ReplaySample(infos, nest.pack_as(source.data_spec, data))

    return _from_generator(generate, element_spec)


def _whole_batches(source: _ItemSource, element_spec: ReplaySample) -> tf.data.Dataset:
    """Items of fully defined shapes: one generator element per fetched batch, split into items by unbatch()."""
    waiting = _no_rows(element_spec)

    def generate() -> Iterator[ReplaySample]:
        for batch in source.batches():
            if batch is None:
                yield waiting
                continue
            columns = []
            for c, (spec, column) in enumerate(zip(source.flat_specs, batch.columns, strict=True)):
                column = np.asarray(column)
                padded = not batch.squeeze[c] and (batch.lengths[:, c] != column.shape[1]).any()
                if padded or not spec.shape.is_compatible_with(column.shape[1:]):
                    lengths = sorted({int(n) for n in batch.lengths[:, c]})
                    raise _mismatch(spec, column.dtype, column.shape[1:], source.table,
                                    f"leaf {c} of items {batch.keys.tolist()}, of lengths {lengths}")
                columns.append(_check_leaf(_outer(spec), column, source.table, f"leaf {c}"))
            yield ReplaySample(batch.info, nest.pack_as(source.data_spec, columns))

    return _from_generator(generate, element_spec)


def _timesteps(source: _ItemSource) -> tf.data.Dataset:
    """One generator element per item (its steps, the info repeated), split into steps by unbatch()."""
    step_spec = ReplaySample(sample_info_specs(), source.data_spec)
    waiting = _no_rows(step_spec)

    def generate() -> Iterator[ReplaySample]:
        for item in source.items():
            if item is None:
                yield waiting
                continue
            info, leaves = item
            lengths = {leaf.shape[0] for leaf in leaves if leaf.ndim > 0}
            if len(lengths) != 1:
                raise ValueError(f"table {source.table!r}: item {info.key} has columns of lengths {sorted(lengths)}; "
                                 "a timestep dataset needs items whose columns all have the same number of steps")
            steps = lengths.pop()
            data = [_check_leaf(s, v, source.table, f"item {info.key}", steps=True)
                    for s, v in zip(source.flat_specs, leaves, strict=True)]
            infos = SampleInfo(*(np.full(steps, v, spec.dtype.as_numpy_dtype)
                                 for v, spec in zip(info, step_spec.info, strict=True)))
            yield ReplaySample(infos, nest.pack_as(source.data_spec, data))

    return _from_generator(generate, step_spec)


class GeneratedDataset(tf.compat.v1.data.Dataset):
    """A ``tf.data.Dataset`` subclass over a pipeline built here (Reverb's datasets are classes, not functions).

    Being a DatasetV1 it also offers TF1's ``make_initializable_iterator`` and
    ``make_one_shot_iterator`` (Reverb's graph-mode code and tests use them).
    """

    def __init__(self, pipeline: tf.data.Dataset):
        self._pipeline = pipeline
        super().__init__()

    def _as_variant_tensor(self) -> tf.Tensor:
        return self._pipeline._variant_tensor

    def _inputs(self) -> list[tf.data.Dataset]:
        return [self._pipeline]  # its options (no injected prefetch) carry over

    @property
    def element_spec(self) -> Any:
        return self._pipeline.element_spec


class TrajectoryDataset(GeneratedDataset):
    """Reverb's ``reverb.TrajectoryDataset``: one element per item, shaped as ``shapes``.

    ``max_in_flight_samples_per_worker`` sets how many items are fetched ahead
    (on tables that may be read ahead); ``num_workers_per_iterator`` and
    ``max_samples_per_stream`` are checked and accepted for Reverb's signature
    (gear's sampler decides both).
    """

    def __init__(self, server_address: str | tf.Tensor, table: str | tf.Tensor, dtypes: Any, shapes: Any,
                 max_in_flight_samples_per_worker: int, num_workers_per_iterator: int = -1,
                 max_samples_per_stream: int = -1, rate_limiter_timeout_ms: int = -1, max_samples: int = -1):
        """Args: as Reverb's (``server_address`` and ``table`` may be constant string tensors).

        Raises:
          ValueError: ``dtypes`` and ``shapes`` differ in structure, or an option is out of range.
          TypeError: ``server_address`` or ``table`` is neither a string nor a constant string tensor.
        """
        _check_common(max_in_flight_samples_per_worker, num_workers_per_iterator, max_samples_per_stream,
                      rate_limiter_timeout_ms, max_samples)
        source = _ItemSource(_as_text(server_address, "server_address"), _as_text(table, "table"),
                             _specs_from(dtypes, shapes), rate_limiter_timeout_ms=rate_limiter_timeout_ms,
                             max_samples=max_samples, max_in_flight=max_in_flight_samples_per_worker,
                             per_step=self._per_step)
        super().__init__(self._build(source))

    _per_step = False  # whether the specs are of one step (TimestepDataset)

    @staticmethod
    def _build(source: _ItemSource) -> tf.data.Dataset:
        return _trajectories(source)

    @classmethod
    def from_table_signature(cls, server_address: str, table: str, max_in_flight_samples_per_worker: int,
                             num_workers_per_iterator: int = -1, max_samples_per_stream: int = -1,
                             rate_limiter_timeout_ms: int = -1, get_signature_timeout_secs: float | None = None,
                             max_samples: int = -1) -> TrajectoryDataset:
        """The dataset of the table signature's specs (shapes and dtypes taken from ``server_info``).

        Raises:
          ValueError: the server has no such table, or the table no signature.
          DeadlineExceededError: no answer within ``get_signature_timeout_secs``.
        """
        signature = table_signature(server_address, table, get_signature_timeout_secs)
        return cls(server_address, table, shapes=nest.map_structure(lambda s: s.shape, signature),
                   dtypes=nest.map_structure(lambda s: s.dtype, signature),
                   max_in_flight_samples_per_worker=max_in_flight_samples_per_worker,
                   num_workers_per_iterator=num_workers_per_iterator, max_samples_per_stream=max_samples_per_stream,
                   rate_limiter_timeout_ms=rate_limiter_timeout_ms, max_samples=max_samples)


class TimestepDataset(TrajectoryDataset):
    """Reverb's ``reverb.TimestepDataset``: one element per step of each item, shaped as ``shapes`` (one step)."""

    _per_step = True

    @staticmethod
    def _build(source: _ItemSource) -> tf.data.Dataset:
        return _timesteps(source)


class ReplayDataset:
    """Reverb's older ``ReplayDataset``: timesteps (``emit_timesteps=True``) or whole sequences.

    With ``emit_timesteps=False`` the shapes include the time dimension and
    ``sequence_length`` (when given) is checked against every item.
    """

    def __new__(cls, server_address: str, table: str, dtypes: Any, shapes: Any, max_in_flight_samples_per_worker: int,
                num_workers_per_iterator: int = -1, max_samples_per_stream: int = -1,
                sequence_length: int | None = None, emit_timesteps: bool = True, rate_limiter_timeout_ms: int = -1,
                max_samples: int = -1) -> tf.data.Dataset:
        _check_common(max_in_flight_samples_per_worker, num_workers_per_iterator, max_samples_per_stream,
                      rate_limiter_timeout_ms, max_samples)
        if sequence_length is not None and sequence_length < 1:
            raise ValueError(f"sequence_length ({sequence_length}) must be None or a positive integer")
        data_spec = _specs_from(dtypes, shapes)
        if not emit_timesteps and sequence_length is not None:
            for spec in nest.flatten(data_spec):
                if spec.shape.rank == 0 or spec.shape[0] not in (None, sequence_length):
                    raise ValueError(f"with emit_timesteps=False, shapes must start with sequence_length "
                                     f"({sequence_length}); got {spec.shape}")
        source = _ItemSource(_as_text(server_address, "server_address"), _as_text(table, "table"), data_spec,
                             rate_limiter_timeout_ms=rate_limiter_timeout_ms, max_samples=max_samples,
                             max_in_flight=max_in_flight_samples_per_worker, per_step=emit_timesteps)
        return GeneratedDataset(_timesteps(source) if emit_timesteps else _trajectories(source, sequence_length))

    @classmethod
    def from_table_signature(cls, server_address: str, table: str, max_in_flight_samples_per_worker: int,
                             num_workers_per_iterator: int = -1, max_samples_per_stream: int = -1,
                             rate_limiter_timeout_ms: int = -1, get_signature_timeout_secs: float | None = None,
                             sequence_length: int | None = None, emit_timesteps: bool = True) -> tf.data.Dataset:
        """From the table signature, read as one step; whole sequences get ``[sequence_length]`` in front."""
        signature = table_signature(server_address, table, get_signature_timeout_secs)
        shapes = nest.map_structure(lambda s: s.shape, signature)
        if not emit_timesteps:
            shapes = nest.map_structure(lambda s: tf.TensorShape([sequence_length]).concatenate(s), shapes)
        return cls(server_address, table, dtypes=nest.map_structure(lambda s: s.dtype, signature), shapes=shapes,
                   max_in_flight_samples_per_worker=max_in_flight_samples_per_worker,
                   num_workers_per_iterator=num_workers_per_iterator, max_samples_per_stream=max_samples_per_stream,
                   sequence_length=sequence_length, emit_timesteps=emit_timesteps,
                   rate_limiter_timeout_ms=rate_limiter_timeout_ms)


def _check_common(max_in_flight_samples_per_worker: int, num_workers_per_iterator: int, max_samples_per_stream: int,
                  rate_limiter_timeout_ms: int, max_samples: int) -> None:
    """Reverb's argument checks (ValueError, in Reverb's words)."""
    if max_in_flight_samples_per_worker < 1:
        raise ValueError(f"max_in_flight_samples_per_worker ({max_in_flight_samples_per_worker}) must be a positive "
                         "integer")
    if num_workers_per_iterator < 1 and num_workers_per_iterator != -1:
        raise ValueError(f"num_workers_per_iterator ({num_workers_per_iterator}) must be a positive integer or -1")
    if max_samples_per_stream < 1 and max_samples_per_stream != -1:
        raise ValueError(f"max_samples_per_stream ({max_samples_per_stream}) must be a positive integer or -1")
    if rate_limiter_timeout_ms < -1:
        raise ValueError(f"rate_limiter_timeout_ms ({rate_limiter_timeout_ms}) must be an integer >= -1")
    if max_samples < 1 and max_samples != -1:
        raise ValueError(f"max_samples ({max_samples}) must be a positive integer or -1")
