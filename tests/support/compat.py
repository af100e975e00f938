"""The Reverb-compatibility suite's backend (gear, or dm-reverb with GEAR_COMPAT_BACKEND=reverb) and helpers over it.

The suite is written the way a Reverb user writes code: ``import gear_client as
reverb``. Setting ``GEAR_COMPAT_BACKEND=reverb`` runs the very same tests against
DeepMind Reverb itself (in ``.venv-reverb``), which is how the expectations here
were checked against the reference; tests of behaviour where gear deliberately
differs (no TensorFlow, a server that survives bad input) carry ``gear_only``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

BACKEND = os.environ.get("GEAR_COMPAT_BACKEND", "gear")
if BACKEND == "reverb":
    import reverb
else:
    import gear_client as reverb

gear_only = pytest.mark.skipif(BACKEND == "reverb", reason="gear behaviour that DeepMind Reverb does not have")

# Seconds a test waits for something that should happen promptly.
PROMPT_S = 10
# Milliseconds after which something that should stay blocked is considered blocked.
BLOCKED_MS = 300


class DuckSpec:
    """The least a signature leaf needs: ``.shape`` and ``.dtype`` (no TensorFlow)."""

    def __init__(self, shape: tuple, dtype: Any):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    def __repr__(self) -> str:
        return f"DuckSpec({self.shape}, {self.dtype})"


def spec(shape: tuple, dtype: Any) -> Any:
    """A signature leaf: a duck-typed spec for gear, a tf.TensorSpec for Reverb."""
    if BACKEND == "reverb":
        import tensorflow as tf

        return tf.TensorSpec(shape, tf.as_dtype(np.dtype(dtype)))
    return DuckSpec(shape, dtype)


def as_numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a numpy or TensorFlow dtype."""
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


def standard_tables() -> list:
    """The tables of the shared per-module server (fresh Table objects)."""
    sel, rl = reverb.selectors, reverb.rate_limiters
    return [
        reverb.Table("uniform", sel.Uniform(), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("prioritized", sel.Prioritized(1.0), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("prioritized_exp0", sel.Prioritized(0.0), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("fifo", sel.Fifo(), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("lifo", sel.Lifo(), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("max_heap", sel.MaxHeap(), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("min_heap", sel.MinHeap(), sel.Fifo(), 1000, rl.MinSize(1)),
        reverb.Table("full_fifo", sel.Fifo(), sel.Fifo(), 3, rl.MinSize(1)),
        reverb.Table("full_min_heap", sel.Fifo(), sel.MinHeap(), 3, rl.MinSize(1)),
        reverb.Table("sampled_twice", sel.Fifo(), sel.Fifo(), 1000, rl.MinSize(1), max_times_sampled=2),
        reverb.Table("sampled_once_min2", sel.Fifo(), sel.Fifo(), 1000, rl.MinSize(2), max_times_sampled=1),
        reverb.Table("min_size_2", sel.Fifo(), sel.Fifo(), 1000, rl.MinSize(2)),
        reverb.Table("rate_limited", sel.Fifo(), sel.Fifo(), 1000, rl.RateLimiter(1.5, 2, -1.0, 3.0)),
        reverb.Table.queue("queue", 10),
        reverb.Table.stack("stack", 10),
        reverb.Table.queue("tiny_queue", 1),
        reverb.Table(
            "signed", sel.Fifo(), sel.Fifo(), 1000, rl.MinSize(1),
            signature={"obs": spec((None, 2), np.float32), "act": spec((None,), np.int64)},
        ),
    ]




def wait_until(predicate: Callable[[], bool], timeout: float = PROMPT_S, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


class InThread:
    """Run a blocking call in a daemon thread and observe whether it finished."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 - reported to the test
                self.error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self, timeout: float = 0.0) -> bool:
        return self._done.wait(timeout)

    def value(self, timeout: float = PROMPT_S) -> Any:
        assert self._done.wait(timeout), "the call did not finish in time"
        if self.error is not None:
            raise self.error
        return self.result


def sample_one(client, table: str, **kwargs):
    """One sample without timestep splitting: a ReplaySample."""
    return next(iter(client.sample(table, 1, emit_timesteps=False, **kwargs)))


def sampled_keys(client, table: str, n: int) -> list[int]:
    return [s.info.key for s in client.sample(table, n, emit_timesteps=False)]


def info_of(client, table: str):
    return client.server_info(timeout=PROMPT_S)[table]


def counters(info) -> dict:
    """The parts of a TableInfo that any change of the table's contents moves."""
    rl = info.rate_limiter_info
    return {
        "current_size": info.current_size,
        "num_episodes": info.num_episodes,
        "num_deleted_episodes": info.num_deleted_episodes,
        "inserts": rl.insert_stats.completed,
        "samples": rl.sample_stats.completed,
        "num_unique_samples": info.num_unique_samples,
    }


def contents(client, table: str, draws: int = 200) -> dict[int, tuple]:
    """Every item of a small uniform table: key -> (priority, data bytes per leaf).

    Found by sampling ``draws`` times; with a few items each is drawn with
    overwhelming probability (3 items, 200 draws: miss chance 3*(2/3)**200).
    """
    out: dict[int, tuple] = {}
    for s in client.sample(table, draws, emit_timesteps=False):
        leaves = s.data if isinstance(s.data, list) else [s.data]
        out[s.info.key] = (s.info.priority, tuple(np.asarray(x).tobytes() for x in leaves))
    return out


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# ------------------------------------------------------------ raw gRPC (gear) ----

def raw_channel(server):
    """A plain gRPC channel to a gear server (for requests no client would send)."""
    import grpc

    return grpc.insecure_channel(f"localhost:{server.port}")


def raw_stub(server):
    from gear_contract._proto import replay_pb2_grpc

    return replay_pb2_grpc.ReplayServiceStub(raw_channel(server))


def tensor(array: np.ndarray):
    """A gear.v1.Tensor holding ``array`` as a raw buffer."""
    from gear_contract._proto import replay_pb2 as pb

    a = np.ascontiguousarray(array)
    return pb.Tensor(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes())


def insert_request(table: str, *, key: int, priority: float, data: np.ndarray, chunk_key: int = 1,
                   episode_id: int = 1):
    """One InsertStream request: a chunk holding ``data`` as a single step, and an item of it.

    The item is what ``client.insert(data, {table: priority})`` creates: one leaf,
    one step, with its time dimension.
    """
    from gear_contract._proto import replay_pb2 as pb

    chunk = pb.ChunkData(chunk_key=chunk_key, data=tensor(np.asarray(data)[None]), episode_id=episode_id,
                         episode_step=0)
    item = pb.PrioritizedItem(
        key=key, table=table, priority=priority, structure=pb.Structure(kind=pb.Structure.LEAF),
        columns=[pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=chunk_key, offset=0, length=1)])],
    )
    return pb.InsertStreamRequest(chunks=[chunk], items=[item])
