"""Datasets for training loops: batches of a table, prefetched in the background where the table allows.

Reverb's datasets are tf.data pipelines; ours are Python iterators that need no
TensorFlow. ``TrajectoryDataset(server_address, table, batch_size, window=...,
device=...)`` yields ``ReplaySample(info, data)`` batches: ``info`` fields are
arrays over the batch, ``data`` the item structure with one
``[batch, steps, *shape]`` array per leaf (zero-padded past each item's length;
``batches()`` also gives the valid lengths). Arrays are NumPy on the CPU; with
``device="cuda"`` they are CuPy arrays in GPU memory (gathered there directly on
the shm plane); ``output="torch"`` / ``output="jax"`` hand them to PyTorch / JAX
through DLPack without a copy.

A background thread fetches batches while the learner trains, as far as the
table's semantics allow (``data_planes.read_ahead``): tables whose sampling takes
nothing away (uniform, prioritized... with a MinSize limiter) are read ahead,
``prefetch`` batches ready and several batches per Select; tables whose samples
consume items (``Table.queue``) or spend a rate limiter's allowance
(``SampleToInsertRatio``) are selected one batch at a time, only when the learner
asks for it, so every item taken from the table is delivered and a batch comes
as soon as one batch's worth can be sampled. ``close()`` (or leaving a ``with``
block) stops the thread cleanly.

When PyTorch is installed the datasets are ``torch.utils.data.IterableDataset``s:
``DataLoader(dataset, batch_size=None)`` takes them as they are, and with
``num_workers > 0`` each worker opens its own session (a dataset pickles as its
address and options, never its sockets; ``max_samples`` is split between the
workers). PyTorch is imported only when it is installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from gear_client import errors
from gear_client.client import Client
from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.range_planning import WindowSpec
from gear_client.data_planes.read_ahead import sampling_takes
from gear_client.data_planes.sampler import PlaneSampler, SamplerClosedError
from gear_client.data_planes.shm import gpu_index, is_gpu_device
from gear_client.replay_sample import ReplaySample
from gear_client.sharding import is_sharded, sharded_sampler
from gear_contract import negotiation

__all__ = ["TrajectoryDataset", "TimestepDataset"]

log = logging.getLogger(__name__)

# The producer on a full queue (or waiting for the learner to ask) and the consumer on an empty queue
# wake this often (seconds) to notice close() or a producer that died.
_POLL_S = 1.0
OUTPUTS = (None, "numpy", "cupy", "torch", "jax")


def _iterable_dataset_base() -> type:
    """``torch.utils.data.IterableDataset`` when PyTorch is installed (imported then), else ``object``."""
    if importlib.util.find_spec("torch") is None:
        return object
    from torch.utils.data import IterableDataset

    return IterableDataset


_BASE = _iterable_dataset_base()
# Reverb's tf.data dataset arguments, which gear's Python datasets do not take (the error says where those are).
_REVERB_ONLY = ("dtypes", "shapes", "max_in_flight_samples_per_worker", "num_workers_per_iterator",
                "max_samples_per_stream", "get_signature_timeout_secs")


def _where_reverbs_are(name: str) -> str:
    return (f"Reverb's tf.data {name}(server_address, table, dtypes, shapes, max_in_flight_samples_per_worker, ...) "
            f"is gear_client.tf.datasets.{name} (needs TensorFlow), which `import reverb` gives with gear's reverb "
            "alias installed (alias/reverb)")


class _DatasetType(type(_BASE)):
    """The datasets' class type: Reverb's class attributes (``from_table_signature``) fail with where they are."""

    def __getattr__(cls, name: str) -> Any:
        if name == "from_table_signature":
            raise AttributeError(
                f"type object {cls.__name__!r} has no attribute {name!r}: gear_client.{cls.__name__} is gear's Python "
                f"iterator, built from a batch_size without the table signature. {_where_reverbs_are(cls.__name__)}")
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


class _Failure:
    """An exception of the producer, handed to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


# What the producer hands over: a batch, a failure, or None at the end.
_Entry = SampledBatch | _Failure | None
_NOT_YET = object()  # _next_batch's answer when its poll time passed without a batch


def _rebuild(cls: type, args: tuple, kwargs: dict) -> TrajectoryDataset:
    """A dataset unpickled (a DataLoader worker's copy): configured now, started on first use in its process."""
    dataset = cls.__new__(cls)
    dataset._configure(*args, **kwargs)
    return dataset


class TrajectoryDataset(_BASE, metaclass=_DatasetType):
    """Batches of trajectories from ``table`` (see module docstring).

    Iterating yields ``ReplaySample(info, data)`` batches. The iteration raises what the
    background producer met: ``ConnectError`` (the daemon stayed unreachable past the connect
    timeout), ``RuntimeError`` (no such table), ``ValueError`` (a batch of items of several layouts
    in a table without a signature, which cannot be stacked).
    """

    def __init__(self, server_address: Any, table: str, batch_size: int | None = None, *reverb_args: Any,
                 window: WindowSpec = None, device: Any = None, output: str | None = None, prefetch: int = 2,
                 planes=None, rate_limiter_timeout_ms: int = -1, max_samples: int = -1,
                 sampler_options: dict | None = None, columns: Any = None, rank: int | None = None,
                 world_size: int | None = None, seed: int | None = None, group_id: str | None = None,
                 **reverb_kwargs: Any):
        """Open a session on ``table`` and start prefetching in the background.

        Args:
          server_address: "host:port" of the daemon, or several daemons holding one sharded table (a list,
            "a:p,b:p" or "shards:NAME:PORT"; docs/SHARDING.md).
          table: the table to sample from.
          batch_size: items per batch (per rank, with ranks).
          window: which steps of each item: None (whole items, zero-padded past each item's length), an
            int ``n`` (the first ``n`` steps), a ``Window``, or one ``Window`` per column.
          device: None for host memory; "cuda", "cuda:N" or a device id for batches in GPU memory.
          output: None (NumPy, or CuPy on a GPU device), "numpy", "cupy", "torch" or "jax" (through DLPack).
          prefetch: batches kept ready ahead of the learner, on tables that may be read ahead.
          planes: the data planes to try ("shm", "rdma", "stream", "inline"; default: all, best first).
          rate_limiter_timeout_ms: end the iteration when no item could be sampled for that long (-1: wait
            forever, as Reverb).
          max_samples: end after that many items (-1: never).
          sampler_options: keyword arguments for the sampler underneath (``PlaneSampler``), e.g.
            ``rdma_device`` or ``num_qps``.
          columns: only these fields are fetched (paths such as ``"obs"`` or ``"obs/rgb"``, or a nest of
            the wanted fields); the batches hold only them.
          rank, world_size: data-parallel ranks on one global selection (default: torch.distributed's
            when it is initialised): rank r of world w gets rows [r B, (r+1) B) of the batch of w B items
            that one sampler with the same seed would get (docs/DATA_PLANES.md).
          seed: the selection's seed, the same on every rank (default: derived from the group id).
          group_id: the ranks' selection group, the same on every rank (default: from torch.distributed's
            rendezvous, else the table, world size and seed).

        Raises:
          ValueError: ``batch_size`` or ``prefetch`` below 1, an unknown ``output`` or plane name, a bad
            rank or world size, or the server address names no port.
          TypeError: Reverb's tf.data arguments (``dtypes``, ``max_in_flight_samples_per_worker``...): the
            message names gear_client.tf.datasets, where Reverb's tf.data datasets are.
        """
        if reverb_args or reverb_kwargs or batch_size is None or not isinstance(batch_size, (int, np.integer)):
            raise self._call_error(batch_size, reverb_args, reverb_kwargs)
        self._configure(server_address, table, batch_size, window=window, device=device, output=output,
                        prefetch=prefetch, planes=planes, rate_limiter_timeout_ms=rate_limiter_timeout_ms,
                        max_samples=max_samples, sampler_options=sampler_options, columns=columns, rank=rank,
                        world_size=world_size, seed=seed, group_id=group_id)
        self._start()

    @classmethod
    def _call_error(cls, batch_size: Any, args: tuple, kwargs: dict) -> TypeError:
        """The TypeError for a call this dataset does not take, saying what it takes and where Reverb's is."""
        name = cls.__name__
        if kwargs:
            given = f"unexpected keyword argument {next(iter(kwargs))!r}"
        elif args:
            given = f"takes 3 positional arguments (server_address, table, batch_size) but {3 + len(args)} were given"
        elif batch_size is None:
            given = "missing the batch_size argument"
        else:
            given = f"batch_size must be an integer, got {type(batch_size).__name__}"
        reverb_call = any(k in _REVERB_ONLY for k in kwargs) or bool(args) or batch_size is None or not isinstance(
            batch_size, (int, np.integer))
        hint = f" {_where_reverbs_are(name)}." if reverb_call else ""
        return TypeError(f"gear_client.{name}() {given}. gear_client.{name} is gear's Python iterator: {name}("
                         "server_address, table, batch_size, *, window=None, device=None, output=None, prefetch=2, "
                         "planes=None, rate_limiter_timeout_ms=-1, max_samples=-1, columns=None, rank=None, "
                         f"world_size=None, seed=None, group_id=None).{hint}")

    def _configure(self, server_address: Any, table: str, batch_size: int, *, window: WindowSpec = None,
                   device: Any = None, output: str | None = None, prefetch: int = 2, planes=None,
                   rate_limiter_timeout_ms: int = -1, max_samples: int = -1,
                   sampler_options: dict | None = None, columns: Any = None, rank: int | None = None,
                   world_size: int | None = None, seed: int | None = None, group_id: str | None = None) -> None:
        """Validate and keep the options; nothing is opened (``_start`` does that in the process that iterates)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be None, 'numpy', 'cupy', 'torch' or 'jax', got {output!r}")
        negotiation.normalise_planes(planes)  # a bad plane name fails here, not in the background
        self._args = (server_address, table, batch_size)
        self._kwargs = {"window": window, "device": device, "output": output, "prefetch": prefetch, "planes": planes,
                        "rate_limiter_timeout_ms": rate_limiter_timeout_ms, "max_samples": max_samples,
                        "sampler_options": sampler_options, "columns": columns, "rank": rank,
                        "world_size": world_size, "seed": seed, "group_id": group_id}
        self.table = table
        self.batch_size = int(batch_size)
        self.window = window
        self.device = device
        self.output = output
        self.max_samples = int(max_samples)
        self._timeout = rate_limiter_timeout_ms / 1000.0 if rate_limiter_timeout_ms >= 0 else None
        self._started_in: int | None = None  # the pid whose producer thread and session this object holds
        self._done = False
        self.plane_kind: str | None = None
        self.read_ahead: bool | None = None  # known once the producer has looked at the table
        self._sampler: PlaneSampler | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        """Open the sampler and start the producer in this process (a DataLoader worker takes its share)."""
        server_address, table, _ = self._args
        kw = self._kwargs
        worker = _torch_worker()
        if worker is not None and self.max_samples >= 0:  # each worker delivers its share of max_samples
            worker_id, workers = worker
            self.max_samples = self.max_samples // workers + (1 if worker_id < self.max_samples % workers else 0)
        self._queue: queue.Queue[_Entry] = queue.Queue(maxsize=kw["prefetch"])
        self._demand = threading.Semaphore(0)  # batches the learner asked for and has not got yet
        self._asked = False
        self._stop = threading.Event()
        self._done = False
        self._started_in = os.getpid()
        options = dict(kw["sampler_options"] or {})
        for name in ("columns", "rank", "world_size", "seed", "group_id"):
            if kw[name] is not None:
                options[name] = kw[name]
        grouped = any(kw[name] is not None for name in ("rank", "world_size", "seed", "group_id"))
        if grouped and worker is not None and worker[1] > 1:
            raise ValueError("rank, world_size, seed or group_id with several DataLoader workers: the workers would "
                             "take one rank's slices in turns; use num_workers <= 1 (one sampler per rank)")
        if is_sharded(server_address):  # several daemons, one table (docs/SHARDING.md)
            self._sampler = sharded_sampler(server_address, table, client_type=Client, planes=kw["planes"],
                                            device=self.device, **options)
        else:
            self._sampler = PlaneSampler(server_address, table, planes=kw["planes"], device=self.device, **options)
        self._thread = threading.Thread(target=self._produce, name=f"gear-dataset-{table}", daemon=True)
        self._thread.start()

    def _ensure_started(self) -> None:
        """Start here when this object was unpickled or inherited through fork (its session is another process's)."""
        if self._started_in != os.getpid():
            self._start()

    def __reduce__(self):
        """Pickles as its address and options (for DataLoader workers), never its sockets or thread."""
        return _rebuild, (type(self), self._args, self._kwargs)

    # ---------------------------------------------------------------- producer
    def _decide_read_ahead(self) -> bool:
        """Whether this table may be read ahead (data_planes.read_ahead); no when its options cannot be read."""
        try:
            info = self._sampler.table_info()
        except (errors.ReverbError, KeyError, ValueError) as exc:
            log.debug("table '%s' options unreadable (%s): selecting one batch at a time", self.table, exc)
            return False
        reason = sampling_takes(info)
        if reason is not None:
            log.debug("dataset of table '%s' selects one batch at a time: %s", self.table, reason)
        return reason is None

    def _produce(self) -> None:
        produced = 0
        stream = None  # the sampler's pipelined batches (full-size batches, tables read ahead only)
        try:
            read_ahead = self.read_ahead = self._decide_read_ahead()
            while not self._stop.is_set():
                want = self.batch_size
                if self.max_samples >= 0:
                    want = min(want, self.max_samples - produced)
                    if want <= 0:
                        break
                if not read_ahead and not self._await_demand():
                    break
                try:
                    if read_ahead and want == self.batch_size:
                        if stream is None:
                            stream = self._sampler.batches(want, window=self.window, timeout=self._timeout)
                        batch = next(stream)
                    else:
                        if stream is not None:
                            stream.close()
                            stream = None
                        batch = self._sampler.sample(want, window=self.window, timeout=self._timeout)
                except errors.DeadlineExceededError:
                    stream = None  # a generator that raised is finished
                    if self._timeout is not None:
                        break  # Reverb ends the stream when the rate limiter times out
                    if not read_ahead:
                        self._demand.release()  # the learner still waits for that batch
                    continue
                self.plane_kind = batch.plane
                produced += len(batch)
                self._put(self._to_output(batch))
        except SamplerClosedError:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            if not self._stop.is_set():
                self._put(_Failure(exc))
        finally:
            if stream is not None:
                try:
                    stream.close()  # releases the leases still in flight
                except Exception:  # noqa: BLE001 - the producer's own failure went first
                    pass
        self._put(None)

    def _await_demand(self) -> bool:
        """Wait until the learner asks for a batch; False when the dataset is closed meanwhile."""
        while not self._stop.is_set():
            if self._demand.acquire(timeout=_POLL_S):
                return True
        return False

    def _put(self, entry: _Entry) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _to_output(self, batch: SampledBatch) -> SampledBatch:
        columns = batch.columns
        if is_gpu_device(self.device) and batch.plane != "shm":
            import cupy as cp

            with cp.cuda.Device(gpu_index(self.device)):
                columns = [cp.asarray(c) for c in columns]
        if self.output == "torch":
            import torch

            columns = [torch.from_dlpack(c) for c in columns]
        elif self.output == "jax":
            import jax.numpy as jnp

            columns = [jnp.from_dlpack(c) for c in columns]
        if columns is not batch.columns:
            batch.columns = list(columns)
        return batch

    # ---------------------------------------------------------------- consumer
    def batches(self, poll_s: float | None = None) -> Iterator[SampledBatch | None]:
        """The batches with everything: info arrays, padded columns and valid lengths.

        ``poll_s``: yield None whenever no batch came within that many seconds, then go on waiting when
        resumed (a caller that must not block for long, as a tf.data generator, which holds one of
        TensorFlow's few threads while it waits).

        Raises:
          ConnectError, RuntimeError, ValueError: as iterating the dataset does.
        """
        while True:
            batch = self._next_batch(poll_s)
            if batch is _NOT_YET:
                yield None
                continue
            if batch is None:
                return
            yield batch

    def _next_batch(self, poll_s: float | None = None) -> Any:
        """The next batch; None at the end; _NOT_YET when ``poll_s`` passed first (still asked for)."""
        if self._done:
            return None
        self._ensure_started()
        if not self._asked:  # one request per batch wanted (tables selected on demand wait for it)
            self._demand.release()
            self._asked = True
        deadline = None if poll_s is None else time.monotonic() + poll_s
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                entry = self._queue.get(timeout=wait)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    return None
                if deadline is not None and time.monotonic() >= deadline:
                    return _NOT_YET
        self._asked = False
        if entry is None:
            self._done = True
            return None
        if isinstance(entry, _Failure):
            self._done = True
            raise entry.error
        return entry

    def __iter__(self) -> TrajectoryDataset:
        self._ensure_started()
        return self

    def __next__(self) -> ReplaySample:
        batch = self._next_batch()
        if batch is None:
            raise StopIteration
        return self._sample_of(batch)

    def _sample_of(self, batch: SampledBatch) -> ReplaySample:
        return batch.sample()

    @property
    def plane(self) -> str | None:
        """The data plane in use ("shm", "rdma", "stream" or "inline"); after close, the last one used."""
        kind = self._sampler.kind if self._sampler is not None else None
        return kind or self.plane_kind

    # ---------------------------------------------------------------- lifecycle
    def close(self, timeout: float = 10.0) -> None:
        """Stop prefetching, end the session, join the thread. Idempotent.

        Args:
          timeout: the most seconds to wait for the background thread.
        """
        if self._started_in != os.getpid():
            # Never started here, or inherited through fork: the session and thread belong to another process.
            self._done = True
            return
        self._stop.set()
        self._sampler.close()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)
        self._done = True

    def __enter__(self) -> TrajectoryDataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout=0.5)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


class TimestepDataset(TrajectoryDataset):
    """Batches of single timesteps: each item's first step, without a time dimension.

    For tables whose items are single steps (``Client.insert``, or writers with
    one-step items): data leaves are ``[batch, *shape]``. It takes
    ``TrajectoryDataset``'s arguments; ``window`` may only be None or 1
    (ValueError otherwise).
    """

    def _configure(self, server_address: Any, table: str, batch_size: int, **kwargs: Any) -> None:
        if kwargs.get("window") not in (None, 1):
            raise ValueError("TimestepDataset takes one step per item; window is not an option")
        kwargs["window"] = 1
        super()._configure(server_address, table, batch_size, **kwargs)

    def _to_output(self, batch: SampledBatch) -> SampledBatch:
        batch.columns = [c if squeezed else c[:, 0] for c, squeezed in zip(batch.columns, batch.squeeze, strict=True)]
        return super()._to_output(batch)


def _torch_worker() -> tuple[int, int] | None:
    """(worker id, number of workers) inside a PyTorch DataLoader worker, else None (torch not imported here)."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return None
    info = data.get_worker_info()
    return None if info is None else (info.id, info.num_workers)
