"""Datasets for training loops: batches of a table, prefetched in the background.

Reverb's datasets are tf.data pipelines; ours are Python iterators that need no
TensorFlow. ``TrajectoryDataset(server_address, table, batch_size, window=...,
device=...)`` yields ``ReplaySample(info, data)`` batches: ``info`` fields are
arrays over the batch, ``data`` the item structure with one
``[batch, steps, *shape]`` array per leaf (zero-padded past each item's length;
``batches()`` also gives the valid lengths). Arrays are NumPy on the CPU; with
``device="cuda"`` they are CuPy arrays in GPU memory (gathered there directly on
the shm plane), and ``output="torch"`` hands them to PyTorch through DLPack
without a copy. A background thread keeps ``prefetch`` batches ready while the
learner trains; ``close()`` (or leaving a ``with`` block) stops it cleanly.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from gear_client import errors
from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.range_planning import WindowSpec
from gear_client.data_planes.sampler import PlaneSampler, SamplerClosedError
from gear_client.data_planes.shm import is_gpu_device
from gear_client.replay_sample import ReplaySample

__all__ = ["TrajectoryDataset", "TimestepDataset"]

_END = object()
# The producer on a full queue and the consumer on an empty one wake this often (seconds) to notice close()
# or a producer that died.
_POLL_S = 1.0


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class TrajectoryDataset:
    """Batches of trajectories from ``table`` (see module docstring).

    ``rate_limiter_timeout_ms``: end the iteration when no item could be sampled
    for that long (-1: wait forever, as Reverb). ``max_samples``: end after that
    many items (-1: never). ``planes``: restrict the data planes to try
    ("shm", "rdma", "inline"). ``output``: None (NumPy / CuPy as the device says)
    or "torch".
    """

    def __init__(self, server_address: Any, table: str, batch_size: int, *, window: WindowSpec = None,
                 device: Any = None, output: str | None = None, prefetch: int = 2, planes=None,
                 rate_limiter_timeout_ms: int = -1, max_samples: int = -1, sampler_options: dict | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if output not in (None, "numpy", "cupy", "torch"):
            raise ValueError(f"output must be None, 'numpy', 'cupy' or 'torch', got {output!r}")
        self.table = table
        self.batch_size = int(batch_size)
        self.window = window
        self.device = device
        self.output = output
        self.max_samples = int(max_samples)
        self._timeout = rate_limiter_timeout_ms / 1000.0 if rate_limiter_timeout_ms >= 0 else None
        self._sampler = PlaneSampler(server_address, table, planes=planes, device=device, **(sampler_options or {}))
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._done = False
        self.plane_kind: str | None = None
        self._thread = threading.Thread(target=self._produce, name=f"gear-dataset-{table}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- producer
    def _produce(self) -> None:
        produced = 0
        stream = None  # the sampler's pipelined batches (full-size batches only)
        try:
            while not self._stop.is_set():
                want = self.batch_size
                if self.max_samples >= 0:
                    want = min(want, self.max_samples - produced)
                    if want <= 0:
                        break
                try:
                    if want == self.batch_size:
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
                except Exception:  # noqa: BLE001
                    pass
        self._put(_END)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _to_output(self, batch: SampledBatch) -> SampledBatch:
        columns = batch.columns
        if is_gpu_device(self.device) and batch.plane != "shm":
            import cupy as cp

            from gear_client.data_planes.shm import gpu_index

            with cp.cuda.Device(gpu_index(self.device)):
                columns = [cp.asarray(c) for c in columns]
        if self.output == "torch":
            import torch

            columns = [torch.from_dlpack(c) for c in columns]
        if columns is not batch.columns:
            batch.columns = list(columns)
        return batch

    # ---------------------------------------------------------------- consumer
    def batches(self) -> Iterator[SampledBatch]:
        """The batches with everything: info arrays, padded columns and valid lengths."""
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            yield batch

    def _next_batch(self) -> SampledBatch | None:
        if self._done:
            return None
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    return None
        if item is _END:
            self._done = True
            return None
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item

    def __iter__(self) -> TrajectoryDataset:
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
        """The data plane in use ("shm", "rdma" or "inline"); after close, the last one used."""
        return self._sampler.kind or self.plane_kind

    # ---------------------------------------------------------------- lifecycle
    def close(self, timeout: float = 10.0) -> None:
        """Stop prefetching, end the session, join the thread. Idempotent."""
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
        except Exception:  # noqa: BLE001
            pass


class TimestepDataset(TrajectoryDataset):
    """Batches of single timesteps: each item's first step, without a time dimension.

    For tables whose items are single steps (``Client.insert``, or writers with
    one-step items): data leaves are ``[batch, *shape]``.
    """

    def __init__(self, server_address: Any, table: str, batch_size: int, **kwargs: Any):
        if kwargs.get("window") not in (None, 1):
            raise ValueError("TimestepDataset takes one step per item; window is not an option")
        kwargs["window"] = 1
        super().__init__(server_address, table, batch_size, **kwargs)

    def _to_output(self, batch: SampledBatch) -> SampledBatch:
        batch.columns = [c if squeezed else c[:, 0] for c, squeezed in zip(batch.columns, batch.squeeze, strict=True)]
        return super()._to_output(batch)
