"""Data-plane benchmark: batches from a learner's point of view, per plane, against their ceilings.

Workload (the core benchmark's): trajectories of 64 steps of {obs: float32[1024],
action: int64, reward: float32} (256.8 KiB each) in a Uniform table of 2048
items, written by a TrajectoryWriter to a daemon in another process. A learner
then takes batches of B items; each figure is end to end (Select over gRPC, the
bytes moved into the learner's memory, Release), in GB/s of item payload:

* inline   PlaneSampler(planes=["inline"]): bytes in gRPC messages, padded batch
* shm      PlaneSampler(planes=["shm"]): segment mapped, NumPy gather into host memory;
           "pipelined": PlaneSampler.batches(): Selects sent ahead (the daemon picks the next batches
           while this one is gathered), several batches per Select (up to 128 items, at most 8 batches:
           4 at B=32, 1 at B=256; one gather reads them all), several gathers running, each lease ended by a
           later Select;
           "1/select": the same pipeline with one batch per Select (the round trip bounds small batches)
* shm-gpu  the same with device="cuda": the gather kernel reads the mapped segment into GPU memory
           (each batch on its own CUDA stream); "deeper": 3 Selects ahead and 4 gathers instead of 2 and 3;
           "8/select" and "1/select": 8 and 1 batches per Select;
           then where one batch's time goes (Select round trip, host launch, gather on the GPU).
           Goal: B=32 shm into GPU memory >= 25 GB/s, printed as met or missed
* dataset  TrajectoryDataset over the best plane, prefetching (what a training loop sees)
* client.sample  Reverb's API (items stacked per column), which picks the best plane itself
* rdma     real verbs when a device exists; otherwise only the software overhead per batch
           (range planning, chains, completions) over an emulated NIC that moves no bytes
* reverb   DeepMind Reverb 0.14's client.sample, side by side in the same run, when
           ``.venv-reverb`` exists (``make bench-reverb`` builds it)

Ceilings printed beside: one thread copying random 256 KiB rows out of a /dev/shm
mapping (the CPU shm plane's; the same from private memory for comparison), the
pinned host-to-device copy (the GPU plane's), and the Sample RPC's undecoded bytes
over loopback (the inline plane's).

Usage: python bench/bench_planes.py [--batches 256 32] [--seconds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_core  # the core workload: trajectories, writer loop, server

ITEM_BYTES = bench_core.ITEM_BYTES
NUM_ITEMS = 2048
GOALS = {"shm_vs_reverb": 10.0, "shm_gpu_gbps": 35.0, "shm_gpu_b32_gbps": 25.0}


def timed(fn, seconds: float, min_reps: int = 3) -> tuple[float, int]:
    """Run fn() (returns items) for about ``seconds``; (elapsed, items)."""
    fn()  # warm-up: connection, negotiation, first-touch of buffers
    items = reps = 0
    start = time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < seconds:
        items += fn()
        reps += 1
    return time.perf_counter() - start, items


def gbps(elapsed: float, items: int) -> float:
    return items * ITEM_BYTES / elapsed / 1e9


# ----------------------------------------------------------------- ceilings --

def memcpy_ceiling(batch: int, shm: bool, reps: int = 5) -> float:
    """One thread copying ``batch`` random 256 KiB rows of a 2048-row table (GB/s, best of ``reps``).

    ``shm``: from a /dev/shm file mapping, as the shm plane reads (its ceiling);
    otherwise from the process's own (anonymous, huge-page backed) memory.
    """
    import mmap

    n = NUM_ITEMS * ITEM_BYTES
    path = None
    if shm:
        path = f"/dev/shm/gear-bench-ceiling-{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, n)
            mapping = mmap.mmap(fd, n)
        finally:
            os.close(fd)
        src = np.frombuffer(mapping, dtype=np.uint8)
    else:
        src = np.empty(n, dtype=np.uint8)
    try:
        src[:] = 1
        dst = np.empty(batch * ITEM_BYTES, dtype=np.uint8)
        dst[:] = 0
        rng = np.random.default_rng(0)
        best = 0.0
        for _ in range(reps):
            slots = rng.integers(0, NUM_ITEMS, batch)
            t0 = time.perf_counter()
            for i, s in enumerate(slots.tolist()):
                dst[i * ITEM_BYTES:(i + 1) * ITEM_BYTES] = src[s * ITEM_BYTES:(s + 1) * ITEM_BYTES]
            best = max(best, dst.nbytes / (time.perf_counter() - t0) / 1e9)
        return best
    finally:
        del src
        if path is not None:
            mapping.close()
            os.unlink(path)


def sample_stream_ceiling(address: str, batch: int, seconds: float) -> float:
    """Bytes per second the Sample RPC streams over loopback, not decoded: the inline plane's ceiling."""
    import grpc

    from gear_contract._proto import replay_pb2 as pb
    from gear_contract.channel import CHANNEL_OPTIONS

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_stream("/gear.v1.ReplayService/Sample",
                                    request_serializer=pb.SampleRequest.SerializeToString, response_deserializer=None)
        request = pb.SampleRequest(table="uniform", num_samples=batch)

        def one() -> int:
            return sum(len(raw) for raw in call(request)) // ITEM_BYTES

        elapsed, items = timed(one, seconds)
    return gbps(elapsed, items)


def h2d_ceiling() -> float | None:
    """Pinned host-to-device copy of 64 MiB (GB/s), or None without a GPU."""
    import gear_kernels

    if not gear_kernels.gpu_available():
        return None
    import cupy as cp

    n = 64 << 20
    host = cp.cuda.alloc_pinned_memory(n)
    src = np.frombuffer(host, dtype=np.uint8, count=n)
    src[:] = 1
    dev = cp.empty(n, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    best = 0.0
    for _ in range(5):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        dev.data.copy_from_host_async(src.ctypes.data, n, stream)
        end.record(stream)
        end.synchronize()
        best = max(best, n / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9)
    return best


# ------------------------------------------------------------------- planes --

def bench_sampler(address: str, batch: int, seconds: float, pipelined: bool = False, pipeline: dict | None = None,
                  **kwargs) -> dict[str, Any]:
    """Batches from PlaneSampler: one by one (Select, gather, Release) or pipelined (batches(**pipeline))."""
    from gear_client.data_planes import PlaneSampler

    with PlaneSampler(address, "uniform", **kwargs) as sampler:
        stream = sampler.batches(batch, **(pipeline or {})) if pipelined else None

        counted = {"batches": -1, "selects": 0}  # after the warm-up batch

        def one() -> int:
            b = next(stream) if stream is not None else sampler.sample(batch)
            assert b.columns[1].shape == (batch, 64, 1024), b.columns[1].shape
            if counted["batches"] < 0:
                counted["selects"] = sampler.selects  # the pipeline's fill is not counted
            counted["batches"] += 1
            return len(b)  # device batches are complete: the plane waited for the gather

        elapsed, items = timed(one, seconds)
        if stream is not None:
            stream.close()
        selects = sampler.selects - counted["selects"]
        per_select = counted["batches"] / selects if selects else None  # None: inline (no Select)
        return {"gbps": gbps(elapsed, items), "plane": sampler.kind, "batches_per_s": items / batch / elapsed,
                "stale_batches": sampler.stale_batches, "batches_per_select": per_select}


def gpu_breakdown(address: str, batch: int, reps: int = 40) -> dict[str, Any]:
    """Where a GPU batch's time goes: Select round trip, host time to launch a gather, the gather on the GPU.

    Medians over ``reps`` batches taken one at a time (nothing overlapping); the
    GPU's part is timed on a second gather of each selection. The
    pipeline hides the round trip when the host's share (launch, waits, handing
    out) stays under the GPU's time per batch.
    """
    import statistics

    import cupy as cp

    from gear_client.data_planes import PlaneSampler
    from gear_kernels.gather import GatherPlan

    rtt, launch, gpu = [], [], []
    with PlaneSampler(address, "uniform", planes=["shm"], device="cuda") as sampler:
        sampler.sample(batch)  # compiles the kernel, creates the plane's streams
        session, plane = sampler._session, sampler._plane
        ncols = len(sampler._layout.columns)
        for _ in range(reps):
            t0 = time.perf_counter()
            selection = session.select(batch, ncols, None)
            t1 = time.perf_counter()
            pending = plane.start(selection, None)
            t2 = time.perf_counter()
            pending.wait()
            # the same gather again, prepared beforehand, so that the events time the GPU's work alone
            plan = GatherPlan(plane.layout, plane._registration, selection.slots, selection.lengths.astype(np.int32))
            stream = cp.cuda.get_current_stream()
            stream.synchronize()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            plan.launch()
            end.record(stream)
            end.synchronize()
            session.release([selection.lease_id])
            rtt.append(t1 - t0)
            launch.append(t2 - t1)
            gpu.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return {"select_rtt_ms": statistics.median(rtt) * 1e3, "launch_host_ms": statistics.median(launch) * 1e3,
            "gather_gpu_ms": statistics.median(gpu) * 1e3}


def bench_dataset(address: str, batch: int, seconds: float, device=None) -> dict[str, Any]:
    import gear_client as reverb

    with reverb.TrajectoryDataset(address, "uniform", batch_size=batch, device=device, prefetch=2) as ds:
        it = ds.batches()

        def one() -> int:
            return len(next(it))

        elapsed, items = timed(one, seconds)
        return {"gbps": gbps(elapsed, items), "plane": ds.plane}


def bench_client_sample(client, batch: int, seconds: float) -> dict[str, Any]:
    elapsed, items = timed(lambda: bench_core.sample_batches(client, "uniform", batch, batch)[1], seconds)
    return {"gbps": gbps(elapsed, items), "plane": getattr(client._planes.get("uniform"), "kind", "inline")}


def bench_rdma_overhead(address: str, batch: int, seconds: float) -> dict[str, Any]:
    """Software cost per batch of the rdma plane (planning, chains, completions) with a NIC that moves nothing."""
    from gear_client.data_planes import range_planning as rp
    from gear_client.data_planes.rdma import DEFAULT_CHAIN_LENGTH, DEFAULT_MAX_SEND_WR, execute_plan
    from gear_client.data_planes.sampler import PlaneSampler
    from gear_contract.rdma_verbs import Completion

    class NullNic:
        def __init__(self):
            self.done: list = []

        def post_reads(self, queue, wr_id, ranges, local, remote):
            self.done.append(Completion(wr_id, True, 0, queue))

        def poll(self, max_entries=32):
            out, self.done = self.done[:max_entries], self.done[max_entries:]
            return out

    with PlaneSampler(address, "uniform", planes=["shm"]) as sampler:
        sampler.open()
        sel = sampler._session.select(batch, None, None)
        sampler._session.release([sel.lease_id])
        layout = sampler._layout
    nic = NullNic()

    def one() -> int:
        windows = rp.resolve_windows(layout, None)
        lay = rp.BatchLayout.build(layout, batch, rp.window_steps(windows))
        src, count, first = rp.window_bounds(sel.lengths, layout, windows)
        ranges = rp.plan_ranges(layout, sel.slots, src, count, lay, first)
        plan = rp.plan_reads(ranges, num_queues=4, max_message=1 << 30, chain_length=DEFAULT_CHAIN_LENGTH,
                             balance_chunk=rp_balance())
        execute_plan(nic, plan, None, None, max_in_flight=DEFAULT_MAX_SEND_WR // DEFAULT_CHAIN_LENGTH)
        return batch

    elapsed, items = timed(one, seconds)
    return {"overhead_ms_per_batch": elapsed / (items / batch) * 1e3, "software_ceiling_gbps": gbps(elapsed, items)}


def rp_balance() -> int:
    from gear_client.data_planes.rdma import BALANCE_CHUNK

    return BALANCE_CHUNK


def bench_rdma_real(address: str, batch: int, seconds: float) -> dict[str, Any] | None:
    from gear_contract import rdma_verbs as verbs

    if verbs.probe() is None:
        return None
    return bench_sampler(address, batch, seconds, planes=["rdma"])


# -------------------------------------------------------------- reverb side --

def reverb_side_by_side(batches: list[int], seconds: float) -> dict[str, Any] | None:
    """DeepMind Reverb's client.sample on the same workload, in its own environment."""
    python = ROOT / ".venv-reverb" / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run([str(python), __file__, "--reverb-only", "--seconds", str(seconds), "--batches",
                          *map(str, batches)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_server(backend: str) -> tuple[Any, Any, int]:
    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=bench_core._serve, args=(backend, NUM_ITEMS, port_queue, stop_event), daemon=True)
    server.start()
    return server, stop_event, port_queue.get(timeout=300)


def stop_server(server, stop_event) -> None:
    stop_event.set()
    server.join(60)
    if server.is_alive():
        server.kill()


def run_reverb_only(batches: list[int], seconds: float) -> dict[str, Any]:
    reverb = bench_core.import_backend("reverb")
    server, stop_event, port = start_server("reverb")
    try:
        client = reverb.Client(f"localhost:{port}")
        bench_core.write_items(client, "uniform", NUM_ITEMS, bench_core._trajectories(8))
        out = {}
        for batch in batches:
            elapsed, items = timed(lambda b=batch: bench_core.sample_batches(client, "uniform", b, b)[1], seconds)
            out[f"b{batch}"] = {"gbps": gbps(elapsed, items)}
        return out
    finally:
        stop_server(server, stop_event)


# --------------------------------------------------------------------- main --

def run(batches: list[int], seconds: float, with_reverb: bool) -> dict[str, Any]:
    import gear_client as reverb
    import gear_kernels

    results: dict[str, Any] = {"machine": machine(), "item_bytes": ITEM_BYTES, "num_items": NUM_ITEMS,
                               "ceilings": {}, "planes": {}}
    gpu = gear_kernels.gpu_available()
    server, stop_event, port = start_server("gear")
    address = f"localhost:{port}"
    try:
        client = reverb.Client(address)
        t0 = time.perf_counter()
        bench_core.write_items(client, "uniform", NUM_ITEMS, bench_core._trajectories(8))
        print(f"wrote {NUM_ITEMS} items in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for batch in batches:
            key = f"b{batch}"
            planes: dict[str, Any] = Figures(batch)
            planes["inline"] = bench_sampler(address, batch, seconds, planes=["inline"])
            planes["shm"] = bench_sampler(address, batch, seconds, planes=["shm"])
            planes["shm pipelined"] = bench_sampler(address, batch, seconds, True, planes=["shm"])
            planes["shm 1/select"] = bench_sampler(address, batch, seconds, True, {"batches_per_select": 1},
                                                   planes=["shm"])
            if gpu:
                planes["shm-gpu"] = bench_sampler(address, batch, seconds, planes=["shm"], device="cuda")
                planes["shm-gpu pipelined"] = bench_sampler(address, batch, seconds, True, planes=["shm"],
                                                            device="cuda")
                planes["shm-gpu deeper"] = bench_sampler(address, batch, seconds, True, {"depth": 4, "prefetch": 3},
                                                         planes=["shm"], device="cuda")
                planes["shm-gpu 8/select"] = bench_sampler(address, batch, seconds, True, {"batches_per_select": 8},
                                                           planes=["shm"], device="cuda")
                planes["shm-gpu 1/select"] = bench_sampler(address, batch, seconds, True, {"batches_per_select": 1},
                                                           planes=["shm"], device="cuda")
                try:  # a diagnostic: never lose the figures above to it
                    results.setdefault("gpu_breakdown", {})[key] = gpu_breakdown(address, batch)
                except Exception as exc:  # noqa: BLE001 - a diagnostic must not end the run
                    print(f"B={batch}: GPU time breakdown failed: {exc!r}", file=sys.stderr)
            planes["dataset"] = bench_dataset(address, batch, seconds, device="cuda" if gpu else None)
            planes["client.sample"] = bench_client_sample(client, batch, seconds)
            real = bench_rdma_real(address, batch, seconds)
            planes["rdma"] = real if real is not None else {"not_run": "no RDMA device on this machine"}
            planes["rdma-software"] = bench_rdma_overhead(address, batch, seconds)
            results["planes"][key] = planes
            results["ceilings"][key] = {"memcpy_shm_gbps": memcpy_ceiling(batch, shm=True),
                                        "memcpy_anon_gbps": memcpy_ceiling(batch, shm=False),
                                        "sample_stream_gbps": sample_stream_ceiling(address, batch, seconds)}
            print(f"B={batch} done", file=sys.stderr)
        results["ceilings"]["h2d_pinned_gbps"] = h2d_ceiling() if gpu else None
        client.close()
    finally:
        stop_server(server, stop_event)
    if with_reverb:
        results["reverb"] = reverb_side_by_side(batches, seconds)
    return results


class Figures(dict):
    """One batch size's figures, each also printed to stderr as it is measured (a later failure loses none)."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def __setitem__(self, name: str, fig: dict[str, Any]) -> None:
        super().__setitem__(name, fig)
        if "gbps" in fig:
            print(f"B={self.batch} {name}: {fig['gbps']:.2f} GB/s", file=sys.stderr, flush=True)


def machine() -> str:
    gpu = ""
    try:
        import gear_kernels

        if gear_kernels.gpu_available():
            import cupy as cp

            gpu = ", GPU " + cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - no GPU details: the line says less
        pass
    return f"{platform.machine()}, {os.cpu_count()} CPUs{gpu}, Python {platform.python_version()}"


def print_results(r: dict[str, Any]) -> None:
    print(f"data-plane benchmark: {r['num_items']} items of {r['item_bytes'] / 1024:.1f} KiB ({r['machine']})")
    for key, planes in r["planes"].items():
        ceil = r["ceilings"][key]
        print(f"  B={key[1:]}:")
        for name, fig in planes.items():
            if "gbps" in fig:
                note = ""
                if name == "inline":
                    note = ("  (ceiling: the Sample RPC's bytes over loopback, undecoded "
                            f"{ceil['sample_stream_gbps']:.2f} GB/s)")
                if name.startswith("shm") and "gpu" not in name:
                    note = (f"  (ceiling: one-thread copy of random rows from /dev/shm {ceil['memcpy_shm_gbps']:.2f}"
                            f" GB/s; from private memory {ceil['memcpy_anon_gbps']:.2f})")
                if name.startswith("shm-gpu"):
                    h2d = r["ceilings"].get("h2d_pinned_gbps")
                    note = (f"  (ceiling: pinned H2D {h2d:.1f} GB/s; goal >= {GOALS['shm_gpu_gbps']:.0f})"
                            if h2d else "")
                per_select = (f", {fig['batches_per_select']:.1f} batches/Select"
                              if fig.get("batches_per_select") else "")
                print(f"    {name:<17} {fig['gbps']:7.2f} GB/s  [{fig.get('plane')}{per_select}]{note}")
            elif "overhead_ms_per_batch" in fig:
                print(f"    {name:<17} {fig['overhead_ms_per_batch']:7.2f} ms/batch of planning+posting+polling "
                      f"(software ceiling {fig['software_ceiling_gbps']:.1f} GB/s; no bytes moved)")
            else:
                print(f"    {name:<17} not run: {fig.get('not_run')}")
        split = (r.get("gpu_breakdown") or {}).get(key)
        if split:
            piped = planes["shm-gpu pipelined"]
            print(f"    shm-gpu time per batch: Select round trip {split['select_rtt_ms']:.2f} ms, host launch "
                  f"{split['launch_host_ms']:.2f} ms, gather on the GPU {split['gather_gpu_ms']:.2f} ms; "
                  f"pipelined {1e3 / piped['batches_per_s']:.2f} ms/batch")
        if key == "b32":
            print_b32_goal(planes)
        rv = (r.get("reverb") or {}).get(key)
        shm = max(planes["shm"]["gbps"], planes["shm pipelined"]["gbps"])
        if rv:
            print(f"    {'reverb 0.14':<14} {rv['gbps']:7.2f} GB/s  [client.sample, same run]  "
                  f"shm/reverb = {shm / rv['gbps']:.1f}x (goal >= {GOALS['shm_vs_reverb']:.0f}x)")
        elif key == "b256":
            print("    reverb 0.14    not run here (no ratio without Reverb measured side by side)")


def print_b32_goal(planes: dict[str, Any]) -> None:
    """The goal of B=32 shm into GPU memory >= 25 GB/s (on a machine without a GPU: the CPU figures instead)."""
    goal = GOALS["shm_gpu_b32_gbps"]
    gpu = [n for n in ("shm-gpu pipelined", "shm-gpu deeper", "shm-gpu 8/select") if n in planes]
    if gpu:
        best = max(gpu, key=lambda n: planes[n]["gbps"])
        fig, one = planes[best], planes.get("shm-gpu 1/select", {}).get("gbps", float("nan"))
        verdict = "met" if fig["gbps"] >= goal else "MISSED"
        print(f"    goal B=32 shm into GPU memory: {fig['gbps']:.2f} GB/s ({best}, "
              f"{fig['batches_per_select']:.1f} batches/Select; one batch per Select {one:.2f}) "
              f"vs >= {goal:.0f} GB/s: {verdict}")
    else:
        fig, one = planes["shm pipelined"], planes["shm 1/select"]
        print(f"    goal B=32 shm into GPU memory >= {goal:.0f} GB/s: no GPU here (make bench-planes-gpu); "
              f"into host memory {fig['gbps']:.2f} GB/s at {fig['batches_per_select']:.1f} batches/Select, "
              f"{one['gbps']:.2f} at one")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--seconds", type=float, default=3.0, help="per figure")
    parser.add_argument("--no-reverb", action="store_true", help="skip DeepMind Reverb side by side")
    parser.add_argument("--reverb-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.reverb_only:
        print(json.dumps(run_reverb_only(args.batches, args.seconds)))
        return 0
    results = run(args.batches, args.seconds, not args.no_reverb)
    print_results(results)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_planes.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
