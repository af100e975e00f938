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
from ._backend import is_device_array, kernel, require_cupy, staging
from ._replay import Replay, ReplayCache
from .rng import CounterRng

# Host-facing calls (draws returned to the host, updates from host arrays) replay
# CUDA graphs: one launch instead of several Python-side launches per call.
USE_GRAPHS = True

SCAN_TILE = twins.SCAN_TILE
KEY_MODES = twins.KEY_MODES

# Mirrors select.cu.
_RS_REMAINING, _RS_EQ, _RS_CANDIDATES, _RS_WORDS = 2, 6, 7, 8
_RADIX_PASSES = 8
_SEARCH_THREADS = 64  # select.cu SEARCH_THREADS
_FUSED_SCATTER_MAX = 1 << 16  # batches up to this many entries take one launch (the last block writes them all)
_FIELDS = {"priority": (1, np.float64), "update_seq": (2, np.int64), "insert_seq": (4, np.int64),
           "valid": (8, np.bool_), "times_sampled": (16, np.int32)}


def _mode(mode: int | str) -> int:
    if isinstance(mode, str):
        try:
            return KEY_MODES[mode]
        except KeyError:
            raise ValueError(f"unknown selection order {mode!r}; expected one of {sorted(KEY_MODES)}") from None
    if mode not in KEY_MODES.values():
        raise ValueError(f"unknown selection order {mode!r}")
    return int(mode)


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
        self.hist = cp.zeros(256, dtype=cp.uint32)
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.grid = int(max(1, min(-(-n // 256), 4 * sms)))
        self.partial = cp.empty(4 * self.grid, dtype=cp.uint64)
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


def top_k(mode: int | str, k: int, valid: Any, *, priority: Any = None, insert_seq: Any = None,
          update_seq: Any = None, rng: CounterRng | None = None) -> Any:
    """The k valid slots that come first in the given order, best first (int64[k]).

    Orders: "max_priority"/"min_priority" (Reverb's heaps: ties go to the item
    least recently inserted or updated, then the lowest slot), "oldest"/"newest"
    (FIFO/LIFO by insert_seq), "random" (a uniform random k-subset in random
    order: uniform sampling without replacement; takes len(valid) counters of
    rng). k larger than the number of valid slots: ValueError.
    """
    m = _mode(mode)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    state = counter0 = 0
    if m == twins.KEY_RANDOM:
        if rng is None:
            raise ValueError("the random order needs an rng")
        state, counter0 = rng.state, rng.take(valid.shape[0])
    if not is_device_array(valid):
        return twins.top_k(m, k, valid, priority, insert_seq, update_seq, state, counter0)
    cp = require_cupy()
    n = valid.shape[0]
    prio, iseq, useq = _order_inputs(cp, m, n, valid, priority, insert_seq, update_seq)
    if k == 0:
        return cp.empty(0, dtype=cp.int64)
    ws = _workspace(cp, n)
    init = np.zeros(_RS_WORDS, dtype=np.uint64)
    init[_RS_REMAINING] = k
    with ws.lock:
        (state_dev,) = staging().upload([init])
        level = 0
        for level in range(3):
            for p in range(_RADIX_PASSES):
                kernel("select", "gear_radix_pass")(
                    (ws.grid,), (256,),
                    (np.int32(m), np.int32(level), np.int32(p), np.int64(n), valid, prio, iseq, useq,
                     np.uint64(state), np.uint64(counter0), state_dev, ws.hist, ws.counters[1:2]))
            st = state_dev.get()
            if level == 0 and k > int(st[_RS_CANDIDATES]):
                raise ValueError(f"top_k: k={k} exceeds the {int(st[_RS_CANDIDATES])} valid slots")
            if st[_RS_EQ] == st[_RS_REMAINING]:
                break
        count = cp.zeros(1, dtype=cp.uint32)
        slots = cp.empty(k, dtype=cp.int64)
        keys = cp.empty((3, k), dtype=cp.uint64)
        kernel("select", "gear_topk_collect")(
            (ws.grid,), (256,),
            (np.int32(m), np.int32(level), np.int64(n), valid, prio, iseq, useq, np.uint64(state),
             np.uint64(counter0), state_dev, np.int64(k), count, slots, keys))
    got = int(count.get()[0])
    if got != k:
        raise RuntimeError(f"top_k collected {got} slots instead of {k} (metadata changed during selection?)")
    order = cp.lexsort(cp.ascontiguousarray(~keys[::-1]))
    return slots[order]


def sample_without_replacement(valid: Any, k: int, rng: CounterRng) -> Any:
    """k distinct valid slots, uniformly at random (each k-subset equally likely), in random order."""
    return top_k("random", k, valid, rng=rng)


def argbest(mode: int | str, valid: Any, *, priority: Any = None, insert_seq: Any = None,
            update_seq: Any = None) -> int:
    """The first valid slot in the given order (a heap's top, FIFO's oldest, LIFO's newest); -1 if none."""
    m = _mode(mode)
    if m == twins.KEY_RANDOM:
        raise ValueError("argbest has no random order; use weighted_sample(uniform=True)")
    if not is_device_array(valid):
        return twins.argbest(m, valid, priority, insert_seq, update_seq)
    cp = require_cupy()
    n = valid.shape[0]
    prio, iseq, useq = _order_inputs(cp, m, n, valid, priority, insert_seq, update_seq)
    if n == 0:
        return -1
    ws = _workspace(cp, n)
    out = cp.empty(1, dtype=cp.int64)
    with ws.lock:
        kernel("select", "gear_argbest")(
            (ws.grid,), (256,),
            (np.int32(m), np.int64(n), valid, prio, iseq, useq, ws.partial, ws.counters[2:3], out))
    return int(out.get()[0])


def _order_inputs(cp: Any, m: int, n: int, valid: Any, priority: Any, insert_seq: Any, update_seq: Any):
    _check_device(cp, "valid", valid, n, cp.bool_)
    if m in (twins.KEY_MAX_PRIORITY, twins.KEY_MIN_PRIORITY):
        _check_device(cp, "priority", priority, n, cp.float64)
        _check_device(cp, "update_seq", update_seq, n, cp.int64)
        return priority, valid, update_seq
    if m in (twins.KEY_OLDEST, twins.KEY_NEWEST):
        _check_device(cp, "insert_seq", insert_seq, n, cp.int64)
        return valid, insert_seq, valid
    return valid, valid, valid  # random: keys come from the rng alone


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


def increment_times_sampled(times_sampled: Any, slots: Any) -> None:
    """times_sampled[slot] += 1 for every occurrence of a slot (a slot drawn twice counts twice)."""
    if not is_device_array(times_sampled):
        twins.increment_times_sampled(times_sampled, slots)
        return
    cp = require_cupy()
    n = times_sampled.shape[0]
    _check_device(cp, "times_sampled", times_sampled, n, cp.int32)
    slots_dev = slots if is_device_array(slots) else staging().upload([np.asarray(slots, dtype=np.int64)])[0]
    slots_dev = slots_dev.astype(cp.int64, copy=False)
    count = slots_dev.shape[0]
    if count:
        kernel("select", "gear_increment_times_sampled")(
            (-(-count // 256),), (256,), (slots_dev, np.int64(count), np.int64(n), times_sampled))
