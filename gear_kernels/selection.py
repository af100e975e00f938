"""Selection over per-slot metadata arrays: GPU kernels (select.cu) or their NumPy twins.

Each function takes the table's metadata arrays (indexed by slot) and runs on
the GPU when they are CuPy arrays, or through the NumPy twin (twins.py) when
they are NumPy arrays; both give the same semantics. Random draws come from a
``CounterRng`` (seed + counter), so the same seed on the same backend gives the
same selection.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import twins
from ._replay import Replay, ReplayCache
from .backend import is_device_array, kernel, require_cupy, staging
from .rng import CounterRng

# Host-facing calls (draws returned to the host, updates from host arrays) replay
# CUDA graphs: one launch instead of several Python-side launches per call.
USE_GRAPHS = True

SCAN_TILE = twins.SCAN_TILE

# Mirrors select.cu.
_SEARCH_THREADS = 64  # select.cu SEARCH_THREADS
_FUSED_SCATTER_MAX = 1 << 16  # batches up to this many entries take one launch (the last block writes them all)
_FIELDS = {"priority": (1, np.float64), "update_seq": (2, np.int64), "insert_seq": (4, np.int64),
           "valid": (8, np.bool_), "times_sampled": (16, np.int32)}


class _Workspace:
    """Scratch device arrays for tables of n slots (kept between calls)."""

    def __init__(self, cp: Any, n: int):
        nb = max(1, -(-n // SCAN_TILE))
        self.n, self.nb = n, nb
        self.sub_prefix = cp.empty(nb * twins.SCAN_THREADS, dtype=cp.float64)
        self.block_sum = cp.empty(nb, dtype=cp.float64)
        self.block_count = cp.empty(nb, dtype=cp.int64)
        self.block_prefix = cp.empty(nb + 1, dtype=cp.float64)
        self.count_prefix = cp.empty(nb + 1, dtype=cp.int64)
        self.counters = cp.zeros(4, dtype=cp.uint32)  # "last block" tickets, zero between launches
        self.winner = None
        self.epoch = 0
        self.lock = threading.Lock()
        self.replays = ReplayCache()


_workspaces: dict[tuple[int, int], _Workspace] = {}
_workspaces_lock = threading.Lock()


def _workspace(cp: Any, n: int) -> _Workspace:
    key = (cp.cuda.Device().id, n)
    with _workspaces_lock:
        ws = _workspaces.get(key)
        if ws is None:
            ws = _workspaces[key] = _Workspace(cp, n)
        return ws


def _check_device(cp: Any, name: str, a: Any, n: int, dtype: Any) -> None:
    if not isinstance(a, cp.ndarray) or a.ndim != 1 or a.shape[0] != n or a.dtype != dtype:
        raise ValueError(f"{name}: expected a 1-D CuPy array of {n} {np.dtype(dtype).name}")
    if not a.flags.c_contiguous or a.data.ptr % 16:
        raise ValueError(f"{name}: expected a contiguous, 16-byte aligned array")


def weighted_sample(priority: Any, valid: Any, batch: int, rng: CounterRng, *, exponent: float = 1.0,
                    uniform: bool = False, host: bool = False) -> tuple[Any, Any]:
    """Draw `batch` slots with replacement: (slots int64[batch], probabilities float64[batch]).

    Prioritized: weight priority**exponent (priority 0 -> weight 0), probability
    w / sum(w); all-zero weights fall back to uniform. uniform=True: uniform over
    the valid slots (priority may be None). No valid slot: slots -1, probability 0.
    host=True: on the GPU path, return NumPy arrays (one pinned device-to-host copy).
    """
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    if not uniform and not math.isfinite(exponent):
        raise ValueError(f"priority exponent must be finite, got {exponent}")
    counter0 = rng.take(batch)
    if not is_device_array(valid):
        return twins.weighted_sample(priority, valid, batch, rng.state, counter0, exponent, uniform)
    cp = require_cupy()
    n = valid.shape[0]
    _check_device(cp, "valid", valid, n, cp.bool_)
    if not uniform:
        _check_device(cp, "priority", priority, n, cp.float64)
    prio = valid if uniform else priority
    mode = np.int32(1 if uniform else 0)
    if host and USE_GRAPHS and batch and n:
        return _weighted_replayed(cp, prio, valid, n, exponent, mode, rng.state, counter0, batch)
    out = cp.empty(2 * batch, dtype=cp.int64)
    slots, probs = out[:batch], out[batch:].view(cp.float64)
    if batch == 0:
        return (slots.get(), probs.get()) if host else (slots, probs)
    if n == 0:
        slots.fill(-1)
        probs.fill(0.0)
    else:
        ws = _workspace(cp, n)
        with ws.lock:
            _launch_weighted(ws, prio, valid, n, exponent, mode, rng.state, counter0, None, batch, slots, probs)
    if host:
        both = staging().download(out)
        return both[:batch], both[batch:].view(np.float64)
    return slots, probs


def _launch_weighted(ws: _Workspace, prio: Any, valid: Any, n: int, exponent: float, mode: Any, state: int,
                     counter0: int, rng_params: Any, batch: int, slots: Any, probs: Any) -> None:
    kernel("select", "gear_weight_scan")(
        (ws.nb,), (256,),
        (prio, valid, np.int64(n), np.float64(exponent), mode, ws.sub_prefix, ws.block_sum, ws.block_count,
         ws.block_prefix, ws.count_prefix, ws.counters[0:1]))
    kernel("select", "gear_weighted_search")(
        (-(-batch // _SEARCH_THREADS),), (_SEARCH_THREADS,),
        (prio, valid, np.int64(n), np.float64(exponent), mode, ws.sub_prefix, ws.block_sum, ws.block_prefix,
         ws.count_prefix, np.int64(ws.nb), np.uint64(state), np.uint64(counter0),
         np.uint64(0) if rng_params is None else rng_params, np.int64(batch), slots, probs))


def _weighted_replayed(cp: Any, prio: Any, valid: Any, n: int, exponent: float, mode: Any, state: int,
                       counter0: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """weighted_sample(host=True) as one graph replay: seed and counter in, slots and probabilities out."""
    ws = _workspace(cp, n)

    def build() -> Replay:
        kernel("select", "gear_weight_scan")
        kernel("select", "gear_weighted_search")  # loaded before capture

        def launch(dev_in: Any, dev_out: Any) -> None:
            out = dev_out[:16 * batch].view(cp.int64)
            _launch_weighted(ws, prio, valid, n, exponent, mode, 0, 0, dev_in[:16].view(cp.uint64), batch,
                             out[:batch], out[batch:].view(cp.float64))

        return Replay(cp, 16, 16 * batch, launch, keep=(prio, valid))

    key = ("weighted", prio.data.ptr, valid.data.ptr, n, float(exponent), int(mode), batch)
    with ws.lock:
        replay = ws.replays.get(key, build)
        replay.host_in[:16].view(np.uint64)[:] = (state, counter0)
        replay.run()
        both = replay.host_out[:16 * batch]
        return both[:8 * batch].view(np.int64).copy(), both[8 * batch:].view(np.float64).copy()


def scatter(slots: Any, targets: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """targets[name][slots] = values[name] for each named field; a duplicated slot takes its last entry.

    Names: priority, update_seq, insert_seq, valid, times_sampled. Slots out of
    range are ignored on the GPU and raise IndexError in the twin, like NumPy.
    On the GPU, host (NumPy) slots and values travel in one pinned copy.
    """
    if set(targets) != set(values):
        raise ValueError("scatter: targets and values must name the same fields")
    unknown = set(targets) - set(_FIELDS)
    if unknown:
        raise ValueError(f"scatter: unknown fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
    names = sorted(targets)
    if not names:
        return
    first = targets[names[0]]
    if not is_device_array(first):
        twins.scatter(slots, [targets[f] for f in names], [values[f] for f in names])
        return
    cp = require_cupy()
    n = first.shape[0]
    for f in names:
        _check_device(cp, f, targets[f], n, _FIELDS[f][1])
    host = [np.ascontiguousarray(slots, dtype=np.int64)] + \
        [np.ascontiguousarray(values[f], dtype=_FIELDS[f][1]) for f in names] if not is_device_array(slots) else None
    if host is not None and USE_GRAPHS and 0 < host[0].shape[0] <= _FUSED_SCATTER_MAX:
        if any(v.shape != host[0].shape for v in host[1:]):
            raise ValueError("scatter: every value array needs one entry per slot")
        _scatter_replayed(cp, n, names, targets, host)
        return
    if host is not None:
        dev = staging().upload(host)
        slots_dev, vals = dev[0], dict(zip(names, dev[1:], strict=True))
    else:
        slots_dev = slots.astype(cp.int64, copy=False)
        vals = {f: cp.asarray(values[f], dtype=_FIELDS[f][1]) for f in names}
    count = slots_dev.shape[0]
    if any(vals[f].shape[0] != count for f in names):
        raise ValueError("scatter: every value array needs one entry per slot")
    if count == 0:
        return
    ws = _workspace(cp, n)
    fields = sum(_FIELDS[f][0] for f in names)
    null_f64 = null_i64 = null_u8 = null_i32 = slots_dev  # never read unless named
    args_vals = (vals.get("priority", null_f64), vals.get("update_seq", null_i64), vals.get("insert_seq", null_i64),
                 vals.get("valid", null_u8), vals.get("times_sampled", null_i32))
    args_targets = (targets.get("priority", null_f64), targets.get("update_seq", null_i64),
                    targets.get("insert_seq", null_i64), targets.get("valid", null_u8),
                    targets.get("times_sampled", null_i32))
    with ws.lock:
        if ws.winner is None or ws.epoch >= 0xFFFFFFFF:
            ws.winner = cp.zeros(n, dtype=cp.uint64)
            ws.epoch = 0
        ws.epoch += 1
        grid = (-(-count // 256),)
        modes = (2,) if count <= _FUSED_SCATTER_MAX else (0, 1)
        for mode in modes:
            kernel("select", "gear_scatter")(
                grid, (256,),
                (np.int32(mode), np.int32(fields), slots_dev, np.int64(count), np.int64(n), np.uint64(ws.epoch),
                 ws.winner, *args_vals, *args_targets, ws.counters[3:4], np.uint64(0)))


def _scatter_replayed(cp: Any, n: int, names: list[str], targets: Mapping[str, Any], host: list[np.ndarray]) -> None:
    """scatter() from host arrays as one graph replay per batch-size bucket (padding entries have slot -1)."""
    ws = _workspace(cp, n)
    count = host[0].shape[0]
    bucket = max(256, 1 << (count - 1).bit_length())
    sizes = [bucket * 8] + [-(-bucket * np.dtype(_FIELDS[f][1]).itemsize // 16) * 16 for f in names]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    epoch_at = int(offsets[-1])
    fields = sum(_FIELDS[f][0] for f in names)
    target_list = [targets[f] for f in names]

    def build() -> Replay:
        kernel("select", "gear_scatter")

        def launch(dev_in: Any, dev_out: Any) -> None:
            slots_dev = dev_in[:bucket * 8].view(cp.int64)
            vals = {f: dev_in[offsets[i + 1]:offsets[i + 1] + bucket * np.dtype(_FIELDS[f][1]).itemsize]
                    .view(_FIELDS[f][1]) for i, f in enumerate(names)}
            null = slots_dev
            args_vals = tuple(vals.get(f, null) for f in ("priority", "update_seq", "insert_seq", "valid",
                                                          "times_sampled"))
            args_targets = tuple(targets.get(f, null) for f in ("priority", "update_seq", "insert_seq", "valid",
                                                                "times_sampled"))
            for mode in (0, 1):  # claim, then write: two graph nodes cost less than one serial last block
                kernel("select", "gear_scatter")(
                    (bucket // 256,), (256,),
                    (np.int32(mode), np.int32(fields), slots_dev, np.int64(bucket), np.int64(n), np.uint64(0),
                     ws.winner, *args_vals, *args_targets, ws.counters[3:4],
                     dev_in[epoch_at:epoch_at + 8].view(cp.uint64)))

        return Replay(cp, epoch_at + 16, 0, launch, keep=tuple(target_list))

    key = ("scatter", fields, tuple(t.data.ptr for t in target_list), n, bucket)
    with ws.lock:
        if ws.winner is None or ws.epoch >= 0xFFFFFFFF:
            ws.winner = cp.zeros(n, dtype=cp.uint64)
            ws.epoch = 0
            ws.replays = ReplayCache()  # graphs hold the old winner array's address
        ws.epoch += 1
        replay = ws.replays.get(key, build)
        buf = replay.host_in
        slots_h = buf[:bucket * 8].view(np.int64)
        slots_h[:count] = host[0]
        slots_h[count:] = -1
        for i, f in enumerate(names):
            itemsize = np.dtype(_FIELDS[f][1]).itemsize
            buf[offsets[i + 1]:offsets[i + 1] + count * itemsize] = host[i + 1].view(np.uint8)
        buf[epoch_at:epoch_at + 8].view(np.uint64)[0] = ws.epoch
        replay.run()
