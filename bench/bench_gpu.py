"""GPU selection and collection benchmark (`make bench-gpu`): figures against the ceilings they work toward.

Measured in one run, on one machine:
  1. the pinned host-to-device copy ceiling (bench_planes.h2d_ceiling: the best of five 64 MiB copies, the
     ceiling bench_planes and bench_shards measure against too);
  2. gather GB/s from a registered /dev/shm segment for items of 4 KiB .. 1 MiB at
     B = 32, 256, 1024 (kernel time by CUDA events; end-to-end from host slots by
     wall clock), beside the NumPy twin (host gather);
  3. prioritized selection latency for N = 1M, 16M at B = 256, 4096, 65536 (end to
     end: draws on the host; and device time), beside the twin and the daemon's
     CPU structure (gear_server.table.selectors.Prioritized);
  4. priority-update latency for 4096 keys (GPU scatter, twin, CPU structure);
  5. the crossover: batch sizes from which the GPU path beats the CPU structure
     per table size (what kernels/offload.py's CROSSOVERS holds).

Usage: python3 bench/bench_gpu.py [--quick] [--json PATH] (JSON also to $OUT/bench_gpu.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
from bench_planes import h2d_ceiling

import gear_kernels as gk
from gear_contract.layout import TableLayout
from gear_kernels import selection, twins
from gear_kernels._replay import Replay
from gear_kernels.gather import GatherPlan
from gear_server.table.selectors.offload import WeightOffload

GOALS = {
    "gather_large": 0.9,  # x pinned ceiling, items >= 64 KiB at B >= 256
    "gather_4k_1024": 0.7,  # x pinned ceiling, 4 KiB items at B = 1024
    "select_4096_of_1m_us": 50.0,
    "update_4096_us": 50.0,
}


def median_wall(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() by the host clock (fn must finish its device work itself)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_events(cp, fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of the device work fn() enqueues, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def shm_segment(nbytes: int, seed: int):
    """A /dev/shm segment (anonymous shared memory if /dev/shm is too small), filled with random bytes."""
    mm = None
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > nbytes + (1 << 30):
            fd, path = tempfile.mkstemp(prefix="gear-bench-", dir="/dev/shm")
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            os.close(fd)
            os.unlink(path)
    except OSError:
        mm = None
    if mm is None:
        mm = mmap.mmap(-1, nbytes)
    view = np.frombuffer(mm, dtype=np.uint8)
    block = np.random.default_rng(seed).integers(0, 256, 1 << 22, dtype=np.uint8)
    for off in range(0, nbytes, block.nbytes):
        n = min(block.nbytes, nbytes - off)
        view[off:off + n] = block[:n]
    del view
    return mm


def _launch_many(plan: GatherPlan, out, times: int) -> None:
    for _ in range(times):
        plan.launch(out)


def bench_gather(cp, ceiling: float, quick: bool) -> list[dict]:
    rows = []
    items = [4 << 10, 64 << 10, 256 << 10, 1 << 20]
    batches = [32, 256, 1024]
    for item in items:
        capacity = 2048 if item < (1 << 20) else 1536
        layout = TableLayout.build("bench", "", capacity, [("x", np.uint8, (item,), 1, False)])
        mm = shm_segment(layout.segment_size, item)
        with gk.HostRegistration(mm) as reg:
            g = np.random.default_rng(item)
            for batch in batches:
                slots = g.choice(capacity, batch, replace=False).astype(np.int64)
                lengths = np.ones((batch, 1), np.int32)
                d_slots, d_lengths = cp.asarray(slots), cp.asarray(lengths)
                plan = GatherPlan(layout, reg, d_slots, d_lengths)
                out = cp.empty(plan.total_bytes, dtype=cp.uint8)
                nbytes = batch * item
                reps = 5 if quick else 20
                # Back-to-back launches between two events: the host's launch overhead overlaps the
                # previous launch, as in a learner that pipelines its batches.
                t_kernel = median_events(cp, functools.partial(_launch_many, plan, out, 10), reps) / 10

                def end_to_end(slots=slots, lengths=lengths, out=out, reg=reg, layout=layout):
                    gk.gather(layout, reg, slots, lengths, out=out)
                    cp.cuda.get_current_stream().synchronize()

                t_e2e = median_wall(end_to_end, reps)
                # Twin: a host gather (no device copy), over fewer repetitions.
                t_twin = median_wall(lambda slots=slots, lengths=lengths, layout=layout, mm=mm:
                                     gk.gather_numpy(layout, mm, slots, lengths), 2 if nbytes > (64 << 20) else 5, 1)
                rows.append({"item_bytes": item, "batch": batch, "bytes": nbytes,
                             "kernel_gbps": nbytes / t_kernel / 1e9, "kernel_us": t_kernel * 1e6,
                             "e2e_gbps": nbytes / t_e2e / 1e9, "e2e_us": t_e2e * 1e6,
                             "x_ceiling": nbytes / t_kernel / ceiling,
                             "twin_gbps": nbytes / t_twin / 1e9})
        del reg, plan, out, d_slots, d_lengths
        mm.close()
    return rows


def filled_prioritized(n: int, weights_of: np.ndarray):
    """gear_server's Prioritized selector holding n items (None if it cannot be imported)."""
    try:
        from gear_server.table.selectors.prioritized import Prioritized
    except Exception as e:  # the daemon's package may be absent on a bare GPU machine
        print(f"  (CPU structure unavailable: {e})")
        return None
    sel = Prioritized(n, priority_exponent=1.0)
    members = sel._members
    members._items[:n] = np.arange(n)
    members._pos[:n] = np.arange(n)
    members._n = n
    sel.update_many(np.arange(n), weights_of, np.arange(n))
    return sel


def _kernels_many(cp, priority, valid, batch: int, exponent: float, times: int) -> None:
    """The selection kernels alone, back to back (device time once launch overhead overlaps)."""
    n = valid.shape[0]
    ws = selection._workspace(cp, n)
    out = ws.__dict__.setdefault(("bench_out", batch), cp.empty(2 * batch, dtype=cp.int64))
    for i in range(times):
        selection._launch_weighted(ws, priority, valid, n, exponent, np.int32(0), 1, i * batch, None, batch,
                                   out[:batch], out[batch:].view(cp.float64))


def _scan_many(cp, ws, dp, dv, exponent: float, times: int) -> None:
    scan = selection.kernel("select", "gear_weight_scan")
    for _ in range(times):
        scan((ws.nb,), (256,), (dp, dv, np.int64(ws.n), np.float64(exponent), np.int32(0), ws.sub_prefix,
                                ws.block_sum, ws.block_count, ws.block_prefix, ws.count_prefix, ws.counters[0:1]))


def _search_many(cp, ws, dp, dv, exponent: float, out, batch: int, times: int) -> None:
    search = selection.kernel("select", "gear_weighted_search")
    for i in range(times):
        search((batch // 64,), (64,), (dp, dv, np.int64(ws.n), np.float64(exponent), np.int32(0), ws.sub_prefix,
                                         ws.block_sum, ws.block_prefix, ws.count_prefix, np.int64(ws.nb), np.uint64(1),
                                         np.uint64(i * batch), np.uint64(0), np.int64(batch), out[:batch],
                                         out[batch:].view(cp.float64)))


def _graph_time(cp, launches, reps: int = 5) -> float:
    """Median seconds of a CUDA graph holding what `launches()` enqueues (no host launch overhead inside)."""
    replay = Replay(cp, 0, 0, lambda dev_in, dev_out: launches())
    return median_events(cp, functools.partial(replay.graph.launch, cp.cuda.get_current_stream()), reps)


def bench_diag(cp) -> list[dict]:
    """Where selection time goes: each kernel alone, back to back, by exponent and size (B = 4096)."""
    rows = []
    batch = 4096
    for n in (1 << 20, 1 << 24):
        dp = cp.asarray(np.random.default_rng(5).uniform(0.01, 10.0, n))
        dv = cp.ones(n, dtype=cp.bool_)
        ws = selection._workspace(cp, n)
        out = cp.empty(2 * batch, dtype=cp.int64)
        for exponent in (1.0, 0.6):
            _scan_many(cp, ws, dp, dv, exponent, 1)  # load the kernels outside any capture
            _search_many(cp, ws, dp, dv, exponent, out, batch, 1)
            t_scan = _graph_time(cp, functools.partial(_scan_many, cp, ws, dp, dv, exponent, 20)) / 20
            t_search = _graph_time(cp, functools.partial(_search_many, cp, ws, dp, dv, exponent, out, batch, 20)) / 20
            rows.append({"n": n, "exponent": exponent, "scan_us": t_scan * 1e6, "search_us": t_search * 1e6})
    return rows


def bench_selection(cp, quick: bool) -> list[dict]:
    """Prioritized draws: exponent 0.6 (weights computed per call) and 1.0 (precomputed weights, the daemon's case)."""
    rows = []
    for n in (1 << 20, 1 << 24):
        g = np.random.default_rng(n)
        priority = g.uniform(0.01, 10.0, n)
        valid = np.ones(n, bool)
        dp, dv = cp.asarray(priority), cp.asarray(valid)
        sel = filled_prioritized(n, priority) if n <= (1 << 22) or not quick else None
        rng = gk.CounterRng(1)
        for exponent in (0.6, 1.0):
            for batch in (256, 4096, 65536):
                reps = 10 if quick else 50
                draw = functools.partial(gk.weighted_sample, dp, dv, batch, rng, exponent=exponent, host=True)
                t_e2e = median_wall(draw, reps)
                selection.USE_GRAPHS = False
                t_e2e_plain = median_wall(draw, reps)
                selection.USE_GRAPHS = True
                t_dev = median_events(cp, functools.partial(_kernels_many, cp, dp, dv, batch, exponent, 10), reps) / 10
                t_twin = median_wall(functools.partial(twins.weighted_sample, priority, valid, batch, 1, 0, exponent),
                                     2, 1)
                t_cpu = None
                if sel is not None:  # the CPU structure holds precomputed weights: its cost has no exponent
                    t_cpu = median_wall(functools.partial(sel.sample, batch, np.random.default_rng(0)),
                                        3 if batch > 4096 else 10, 1)
                rows.append({"n": n, "batch": batch, "exponent": exponent, "gpu_e2e_us": t_e2e * 1e6,
                             "gpu_e2e_no_graph_us": t_e2e_plain * 1e6, "gpu_device_us": t_dev * 1e6,
                             "twin_us": t_twin * 1e6, "cpu_structure_us": None if t_cpu is None else t_cpu * 1e6})
    return rows


def bench_updates(cp, quick: bool) -> dict:
    n, k = 1 << 20, 4096
    g = np.random.default_rng(3)
    priority = g.uniform(0.01, 10.0, n)
    dev = cp.asarray(priority)
    host = priority.copy()
    reps = 20 if quick else 200
    keys = [g.choice(n, k, replace=False) for _ in range(8)]
    vals = [g.uniform(0.01, 10.0, k) for _ in range(8)]
    i = iter(range(10**9))

    def gpu():
        j = next(i) % 8
        gk.scatter(keys[j], {"priority": dev}, {"priority": vals[j]})
        cp.cuda.get_current_stream().synchronize()

    t_gpu = median_wall(gpu, reps)
    selection.USE_GRAPHS = False
    t_plain = median_wall(gpu, reps)
    selection.USE_GRAPHS = True
    t_twin = median_wall(lambda: twins.scatter(keys[0], [host], [vals[0]]), 20)
    d_keys, d_vals = cp.asarray(keys[0]), cp.asarray(vals[0])
    t_dev = median_events(cp, lambda: gk.scatter(d_keys, {"priority": dev}, {"priority": d_vals}), reps)
    sel = filled_prioritized(n, priority)
    t_cpu = None
    if sel is not None:
        t_cpu = median_wall(lambda: sel.update_many(keys[1], vals[1], np.arange(k)), 20)
    return {"n": n, "keys": k, "gpu_e2e_us": t_gpu * 1e6, "gpu_e2e_no_graph_us": t_plain * 1e6,
            "gpu_device_us": t_dev * 1e6, "twin_us": t_twin * 1e6,
            "cpu_structure_us": None if t_cpu is None else t_cpu * 1e6}


def bench_uniform(cp, quick: bool) -> list[dict]:
    n = 1 << 20
    valid = np.ones(n, bool)
    dv = cp.asarray(valid)
    rows = []
    reps = 5 if quick else 20
    rng = gk.CounterRng(2)
    t = median_wall(lambda: gk.weighted_sample(None, dv, 4096, rng, uniform=True, host=True), reps)
    rows.append({"op": "uniform B=4096", "n": n, "gpu_e2e_us": t * 1e6,
                 "twin_us": median_wall(lambda: twins.weighted_sample(None, valid, 4096, 1, 0, uniform=True), 2, 1)
                 * 1e6})
    return rows


def bench_crossover(cp, quick: bool) -> list[dict]:
    """Per table size and batch, one RL step on each path: B priority updates, then B draws."""
    rows = []
    sizes = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
    batches = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
    for n in sizes:
        g = np.random.default_rng(n + 1)
        priority = g.uniform(0.01, 10.0, n)
        paths = {}
        for name in ("cpu", "gpu", "twin"):
            sel = filled_prioritized(n, priority)
            if sel is None:
                return rows
            sel._offload = WeightOffload(sel._w, backend=name)
            paths[name] = sel
        nrng = np.random.default_rng(0)
        paths["gpu"].sample(1, nrng)  # first upload
        for batch in batches:
            upd = g.choice(n, min(batch, n), replace=False)
            vals = g.uniform(0.01, 10.0, upd.shape[0])
            seqs = np.arange(upd.shape[0]) + n
            reps = 3 if (quick or batch >= 16384) else 10
            row = {"n": n, "batch": batch}
            for name, sel in paths.items():
                r = 2 if (name == "twin" and n >= (1 << 20)) else reps
                t = median_wall(functools.partial(_rl_step, sel, upd, vals, seqs, batch, nrng), r, 1)
                row[f"{name}_step_us"] = t * 1e6
            rows.append(row)
    return rows


def _rl_step(sel, slots: np.ndarray, values: np.ndarray, seqs: np.ndarray, batch: int, rng: np.random.Generator):
    """One learner step on a selector: update the priorities of `slots`, then draw a batch."""
    sel.update_many(slots, values, seqs)
    return sel.sample(batch, rng)


def crossovers(rows: list[dict]) -> list[dict]:
    """Per table size: the smallest batch from which a path beats the CPU structure at every larger batch."""
    out = []
    for n in sorted({r["n"] for r in rows}):
        rs = sorted((r for r in rows if r["n"] == n), key=lambda r: r["batch"])
        found = {}
        for name in ("gpu", "twin"):
            found[name] = next((r["batch"] for r in rs if all(q[f"{name}_step_us"] < q["cpu_step_us"]
                                                              for q in rs if q["batch"] >= r["batch"])), None)
        out.append({"n": n, "gpu_min_batch": found["gpu"], "twin_min_batch": found["twin"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--sections", default="diag,gather,select,update,uniform,crossover",
                        help="comma-separated: diag,gather,select,update,uniform,crossover")
    args = parser.parse_args()
    if not gk.gpu_available():
        print("bench_gpu: no usable GPU (CuPy and a CUDA device are needed)", file=sys.stderr)
        return 2
    import cupy as cp

    sections = set(args.sections.split(","))
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    result = {"date": datetime.date.today().isoformat(), "device": props["name"].decode(),
              "cupy": cp.__version__, "numpy": np.__version__, "python": platform.python_version(),
              "cpu_count": os.cpu_count()}
    print(f"# gear GPU kernels benchmark, {result['date']}, {result['device']}, cupy {result['cupy']}")
    ceiling = h2d_ceiling() * 1e9  # the one ceiling every GPU bench measures against (bench_planes)
    result["pinned_h2d_gbps"] = ceiling / 1e9
    print(f"pinned host-to-device copy ceiling: {ceiling / 1e9:.1f} GB/s")
    if "diag" in sections:
        result["diag"] = bench_diag(cp)
        print("\nselection kernels alone (20 launches in one CUDA graph; B = 4096)")
        for r in result["diag"]:
            print(f"N={r['n']:>9} exponent {r['exponent']}: scan {r['scan_us']:.1f} us, search {r['search_us']:.1f} us")
    if "gather" in sections:
        result["gather"] = bench_gather(cp, ceiling, args.quick)
        print("\ngather (registered /dev/shm -> device)   goal: >= 0.9x ceiling for >= 64 KiB at B >= 256; "
              ">= 0.7x for 4 KiB at B = 1024")
        print(f"{'item':>8} {'B':>5} {'kernel GB/s':>12} {'x ceiling':>10} {'kernel us':>10} {'e2e GB/s':>9} "
              f"{'twin GB/s':>10}")
        for r in result["gather"]:
            print(f"{r['item_bytes'] >> 10:>6}Ki {r['batch']:>5} {r['kernel_gbps']:>12.1f} {r['x_ceiling']:>10.2f} "
                  f"{r['kernel_us']:>10.1f} {r['e2e_gbps']:>9.1f} {r['twin_gbps']:>10.2f}")
    if "select" in sections:
        result["select"] = bench_selection(cp, args.quick)
        print("\nprioritized selection (draws returned to the host)   goal: 4096 of 1M in < 50 us")
        print(f"{'N':>9} {'exp':>4} {'B':>6} {'GPU e2e us':>11} {'no graph':>9} {'launches us':>12} {'twin us':>10} "
              f"{'CPU struct us':>14}")
        for r in result["select"]:
            cpu = "-" if r["cpu_structure_us"] is None else f"{r['cpu_structure_us']:.0f}"
            print(f"{r['n']:>9} {r['exponent']:>4} {r['batch']:>6} {r['gpu_e2e_us']:>11.1f} "
                  f"{r['gpu_e2e_no_graph_us']:>9.1f} {r['gpu_device_us']:>12.1f} {r['twin_us']:>10.0f} {cpu:>14}")
    if "update" in sections:
        u = result["update"] = bench_updates(cp, args.quick)
        cpu = "-" if u["cpu_structure_us"] is None else f"{u['cpu_structure_us']:.0f}"
        print(f"\npriority updates, {u['keys']} keys into {u['n']}   goal: < 50 us")
        print(f"GPU e2e {u['gpu_e2e_us']:.1f} us (no graph {u['gpu_e2e_no_graph_us']:.1f} us; device "
              f"{u['gpu_device_us']:.1f} us), twin {u['twin_us']:.0f} us, "
              f"CPU structure {cpu} us")
    if "uniform" in sections:
        result["uniform"] = bench_uniform(cp, args.quick)
        print("\nuniform selection over 1M")
        for r in result["uniform"]:
            print(f"{r['op']:>26}: GPU e2e {r['gpu_e2e_us']:.0f} us, twin {r['twin_us']:.0f} us")
    if "crossover" in sections:
        rows = result["crossover"] = bench_crossover(cp, args.quick)
        result["crossovers"] = crossovers(rows)
        print("\ncrossover: one step = update B priorities, then draw B (prioritized selector, per path)")
        print(f"{'N':>9} {'B':>6} {'CPU struct us':>14} {'GPU us':>9} {'twin us':>9}")
        for r in rows:
            print(f"{r['n']:>9} {r['batch']:>6} {r['cpu_step_us']:>14.0f} {r['gpu_step_us']:>9.0f} "
                  f"{r['twin_step_us']:>9.0f}")
        for c in result["crossovers"]:
            print(f"N={c['n']}: GPU from B={c['gpu_min_batch']}, twin from B={c['twin_min_batch']}")
    text = json.dumps(result, indent=1)
    for path in filter(None, [args.json, os.path.join(os.environ["OUT"], "bench_gpu.json")
                              if os.environ.get("OUT") else None]):
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
