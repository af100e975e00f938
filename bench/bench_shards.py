"""Sharding benchmark: one table over 1, 2 and 4 daemons on this host (docs/SHARDING.md).

Every daemon is its own ``gear-server`` process with its own shm segments; the
client sees them as one table (``reverb.Client([a, b, ...])``). Figures:

* insert   same-host actors (one process each, ``--actors-per-shard`` per daemon) write
           the core workload's trajectories (64 steps of obs float32[1024], 256.8 KiB)
           through a ShardedClient: each actor's writers go to the daemons in turn, so
           the load spreads. Aggregate GB/s; goal >= 0.8 x N x the one-daemon figure.
* pull     one learner's TrajectoryDataset over all daemons, B items per batch, each
           shard's part over its best plane (shm here; ``--planes inline`` forces gRPC),
           into GPU memory with ``--device cuda``. GB/s of item payload; goal on the GPU
           machine >= 0.9 x the PCIe ceiling (55 GB/s pinned H2D) however many shards.
           With inline collection on a small machine, the per-shard overhead: ms per batch
           against one daemon.
* select   prioritized selection of 4096 over 4 shards of ``--prio-items`` one-step items
           each. Goal: under 100 us at 1M items. (a) selection alone, end to end per batch
           (masses asked or reused, batch split, the shards' Selects fanned out at once, keys
           and global probabilities back, nothing collected); (b) selection read ahead (Selects
           of one or 8 batches' picks in flight per shard, as the read-ahead streams send them):
           the cost per batch on the learner's path; (c) with collection: sample() (the parts'
           8-byte items collected and assembled) and read-ahead batches().

Usage: python bench/bench_shards.py [--full] [--device cuda] [--no-insert] [--shards N ...] [--json PATH]
(``make bench-shards``: small, CPU, inline collection; ``make bench-shards-gpu``: full, on the GPU machine,
each shard over its best plane: shm here.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_core  # the core workload: trajectories, writer loop, server

ITEM_BYTES = bench_core.ITEM_BYTES
PCIE_GBPS = 55.6  # pinned host-to-device copy, H200 machine (ARCHITECTURE.md): only where it cannot be measured
GOALS = {"insert_scaling": 0.8, "pull_vs_pcie": 0.9, "select_us": 100.0}
SELECT_BATCH = 4096
SELECT_SHARDS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(port: int, instance: str, max_size: int, prio_items: int) -> str:
    return f'''
bind_address = "127.0.0.1"
port = {port}
instance_name = "{instance}"

[[tables]]
name = "t"
sampler = "uniform"
remover = "fifo"
max_size = {max_size}
rate_limiter = {{ min_size = 1 }}

[[tables]]
name = "p"
sampler = {{ prioritized = {{ priority_exponent = 0.6 }} }}
remover = "fifo"
max_size = {max(prio_items, 1)}
rate_limiter = {{ min_size = 1 }}

[logging]
level = "WARNING"
'''


class Daemons:
    """N gear-server processes on loopback (each its own shm segments)."""

    def __init__(self, n: int, folder: Path, max_size: int, prio_items: int):
        self.procs = []
        self.addresses = []
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for i in range(n):
            port = _free_port()
            path = folder / f"shard{i}.toml"
            path.write_text(_config(port, f"benchshard{os.getpid()}n{n}s{i}", max_size, prio_items))
            log = open(folder / f"shard{i}.log", "wb")  # noqa: SIM115 - closed with the process
            self.procs.append((subprocess.Popen([sys.executable, "-m", "gear_server", "--config", str(path)],
                                                stdout=log, stderr=log, env=env), log))
            self.addresses.append(f"127.0.0.1:{port}")
        import gear_client as reverb

        for address, (proc, _) in zip(self.addresses, self.procs, strict=True):
            host, port = address.rsplit(":", 1)
            deadline = time.monotonic() + 60
            while True:  # the port first (quietly), then one call
                if proc.poll() is not None:
                    raise RuntimeError(f"gear-server for {address} exited ({proc.returncode}); see {folder}")
                try:
                    socket.create_connection((host, int(port)), timeout=1.0).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            reverb.Client(address).server_info(timeout=30.0)

    def stop(self) -> None:
        for proc, _log in self.procs:
            proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


# ---------------------------------------------------------------- inserts --

def _actor(addresses: list[str], shard: int, seconds: float, seed: int, ready, go, out) -> None:
    """One actor process: a ShardedClient over every daemon and ONE trajectory writer, on daemon ``shard``.

    A real actor runs one environment loop whose writer goes to its own host's daemon; here every daemon is
    on this host, where the routing takes this host's daemons in turn from a random start, so the actor keeps
    the one of its client's next N writers (which cover the N daemons) that landed on its daemon: every
    daemon gets the same number of actors at every N. (The first version gave each actor N writers, one per
    daemon, rotating items over them: each actor then paid N streams, N sets of column buffers and N segment
    mappings, so the per-actor cost grew with N, which no real placement has; and its clock ran from before
    the first item, across the spawn stagger of the other actors.) After a warm-up (stream or insert plane
    open, the layout known) it reports ready, waits for ``go`` (every actor starts together), writes for
    ``seconds`` and reports (shard, items, seconds, process CPU seconds, path).
    """
    import resource

    import gear_client as reverb

    client = reverb.Client(addresses, seed=seed)
    pool = bench_core._trajectories(4, seed)
    steps = [[{k: tr[k][t] for k in tr} for t in range(bench_core.STEPS)] for tr in pool]
    writer, others = None, []
    for _ in range(len(addresses)):
        w = client.trajectory_writer(num_keep_alive_refs=bench_core.STEPS)
        if w._client.server_address == addresses[shard]:
            writer = w
            break
        others.append(w)
    for w in others:
        w.close()
    if writer is None:
        raise RuntimeError(f"no writer of {len(addresses)} landed on {addresses[shard]}")

    def one(i: int) -> None:
        for step in steps[i % len(steps)]:
            writer.append(step)
        writer.create_item("t", 1.0, {k: writer.history[k][-bench_core.STEPS:] for k in ("obs", "action", "reward")})

    for i in range(3):
        one(i)
    writer.flush()
    path = "insert plane" if writer._same_host.writer is not None else "InsertStream"
    ready.put(os.getpid())
    go.wait()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    items = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        one(items)
        items += 1
    writer.flush()
    elapsed = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    writer.close()
    client.close()
    out.put((shard, items, elapsed, usage.ru_utime + usage.ru_stime - cpu0, path))


def bench_insert(addresses: list[str], actors: int, seconds: float) -> dict[str, Any]:
    """``actors`` same-host actor processes, actor i on daemon i % N, all writing at once for ``seconds``.

    Aggregate GB/s (every actor's items over the longest actor's time) and per actor: GB/s and CPU
    microseconds per item (a per-actor cost that grows with N is the client's; a rate that falls at
    the same CPU per item means the actors wait: daemons or cores).
    """
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    n = len(addresses)
    procs = [ctx.Process(target=_actor, args=(addresses, i % n, seconds, i, ready, go, out)) for i in range(actors)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=180)
        go.set()
        results = [out.get(timeout=seconds + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    items = sum(r[1] for r in results)
    elapsed = max(r[2] for r in results)
    per_actor = [r[1] * ITEM_BYTES / r[2] / 1e9 for r in results]
    cpu_us = [r[3] / max(r[1], 1) * 1e6 for r in results]
    per_shard = [0] * n
    for r in results:
        per_shard[r[0]] += 1
    print(f"  insert: {actors} actors ({'+'.join(map(str, per_shard))} per daemon, {results[0][4]}): "
          f"per actor {min(per_actor):.3f}-{max(per_actor):.3f} GB/s (mean {np.mean(per_actor):.3f}), "
          f"{np.median(cpu_us):.0f} us CPU per item", flush=True)
    return {"items": items, "actors": actors, "gbps": items * ITEM_BYTES / elapsed / 1e9,
            "per_actor_gbps": per_actor, "actor_gbps_mean": float(np.mean(per_actor)),
            "cpu_us_per_item": float(np.median(cpu_us)), "actors_per_daemon": per_shard,
            "paths": sorted({r[4] for r in results})}


# ---------------------------------------------------------------- learner pull --

def bench_pull(addresses: list[str], batch: int, seconds: float, planes: list[str] | None, device: Any
               ) -> dict[str, Any]:
    import gear_client as reverb

    target = addresses if len(addresses) > 1 else addresses[0]
    with reverb.TrajectoryDataset(target, "t", batch_size=batch, planes=planes, device=device) as ds:
        it = ds.batches()
        next(it)  # warm-up: sessions, mappings, first buffers
        items = n = 0
        start = time.perf_counter()
        while n < 3 or time.perf_counter() - start < seconds:
            b = next(it)
            items += len(b)
            n += 1
        if device is not None:
            import cupy as cp

            cp.cuda.runtime.deviceSynchronize()
        elapsed = time.perf_counter() - start
        plane = ds.plane
    return {"gbps": items * ITEM_BYTES / elapsed / 1e9, "ms_per_batch": elapsed / n * 1e3, "plane": plane}


# ---------------------------------------------------------------- selection --

def _fill_prio(address: str, items: int, seed: int) -> None:
    import gear_client as reverb

    rng = np.random.default_rng(seed)
    priorities = rng.uniform(0.1, 10.0, items)
    client = reverb.Client(address)
    with client.trajectory_writer(num_keep_alive_refs=1) as w:
        for i in range(items):
            w.append({"x": np.int64(i)})
            w.create_item("p", float(priorities[i]), {"x": w.history["x"][-1]})
            if i % 4096 == 4095:
                w.flush()


class _Sessions:
    """One data-plane session per shard, for Selects without collection (keys, probabilities, leases only).

    The client's samplers always collect what they select; these sessions show
    what selection alone costs: the same Select the shm plane sends (over the
    daemon's local lane, as a sampler's session), its lease ended by the shard's
    next Select (or at close).
    """

    def __init__(self, addresses: list[str], table: str):
        from gear_client.data_planes.session import PlaneSession
        from gear_client.data_planes.targets import connect
        from gear_contract import negotiation
        from gear_contract._proto import replay_pb2 as pb

        self.channels, self.sessions = [], []
        offer = negotiation.build_offer([negotiation.SHM], negotiation.local_host_id(), None)
        for address in addresses:
            stub, _, channel, daemon = connect(address)
            self.channels.append(channel)
            response = stub.OpenDataPlane(pb.OpenDataPlaneRequest(table=table, offer=offer), timeout=30)
            if response.kind != negotiation.SHM:
                raise RuntimeError(f"{address} offered {response.kind!r}, not shm: selection alone needs a session")
            self.sessions.append(PlaneSession(stub, table, response, daemon=daemon))  # its lane, as a sampler's
        self.release: list[list[int]] = [[] for _ in addresses]  # per shard: leases its next Select ends

    def select(self, counts: dict[int, int]) -> dict[int, Any]:
        """Every shard's Select at once (gRPC futures, no thread hop); shard -> its ItemSelection."""
        pending = {}
        for shard, n in counts.items():
            pending[shard] = self.sessions[shard].select_async(n, None, None, self.release[shard])
            self.release[shard] = []
        out = {}
        for shard, call in pending.items():
            selection, _ = call.result()
            self.release[shard].append(selection.lease_id)
            out[shard] = selection
        return out

    def close(self) -> None:
        for session, channel in zip(self.sessions, self.channels, strict=True):
            session.close()  # ends the leases still held
            if channel is not None:
                channel.close()


class _SelectAhead:
    """Selections read ahead per shard as the read-ahead streams do (gear_client/sharding/streams.py), without
    collection: a thread per shard keeps ``prefetch`` Selects of ``chunk`` picks in flight and queues their
    answers; a batch takes its split's count from every shard's picks in order and is globalised."""

    def __init__(self, sessions: _Sessions, chunk: int, prefetch: int, depth: int = 2):
        import queue
        import threading

        self.sessions, self.chunk, self.prefetch = sessions, chunk, prefetch
        n = len(sessions.sessions)
        self.queues = [queue.Queue(maxsize=depth) for _ in range(n)]
        self.left: list[tuple[np.ndarray, ...] | None] = [None] * n  # picks of a chunk not yet taken
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, shard: int) -> None:
        import queue
        from collections import deque

        session, pending = self.sessions.sessions[shard], deque()
        release, self.sessions.release[shard] = self.sessions.release[shard], []
        while not self.stop.is_set():
            while len(pending) < self.prefetch:
                pending.append(session.select_async(self.chunk, None, None, release))
                release = []
            selection, _ = pending.popleft().result()
            release.append(selection.lease_id)  # ended by this shard's next Select
            _, probs, sizes, prios, _ = selection.infos
            while not self.stop.is_set():
                try:
                    self.queues[shard].put((prios, probs, sizes), timeout=0.2)
                    break
                except queue.Full:
                    continue
        for call in pending:  # nothing left in flight; their leases end with the session
            call.result()

    def take(self, shard: int, n: int) -> tuple[np.ndarray, ...]:
        got, have = [], 0
        while have < n:
            picks = self.left[shard] if self.left[shard] is not None else self.queues[shard].get(timeout=30)
            self.left[shard] = None
            k = min(n - have, len(picks[0]))
            got.append(tuple(f[:k] for f in picks))
            if k < len(picks[0]):
                self.left[shard] = tuple(f[k:] for f in picks)
            have += k
        return got[0] if len(got) == 1 else tuple(np.concatenate(f) for f in zip(*got, strict=True))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def bench_select(addresses: list[str], items: int, reps: int) -> dict[str, Any]:
    """Prioritized selection of SELECT_BATCH over the shards: (a) selection alone, one batch at a time
    (the Selects fanned out at once, keys and probabilities back, nothing collected); (b) selection read
    ahead, amortised per batch on the learner's path; (c) with collection (sample(), read-ahead batches())."""
    import gear_client as reverb
    from gear_client.sharding import sharded_sampler
    from gear_client.sharding.selection import globalise, split

    ctx = mp.get_context("spawn")
    fill_start = time.perf_counter()
    # each shard filled by several writers at once where there are cores for them (1M items a shard)
    writers = max(1, min(4, (os.cpu_count() or 1) // (2 * len(addresses))))
    share = [items // writers + (w < items % writers) for w in range(writers)]
    procs = [ctx.Process(target=_fill_prio, args=(a, share[w], i * writers + w))
             for i, a in enumerate(addresses) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    fill_s = time.perf_counter() - fill_start
    client = reverb.Client(addresses)
    sampler = client.sampler("p")
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"items_per_shard": items, "fill_s": fill_s}

    # (a) selection alone: masses asked (ServerInfo fan-out) or reused, split, Selects fanned out, globalised
    sessions = _Sessions(addresses, "p")
    policy, weights = sampler.weights()
    shard_of = {s.index: addresses.index(s.address) for s in sampler.shards.shards}  # shard -> its session

    def select_once(fresh: bool) -> int:
        nonlocal policy, weights
        if fresh:
            policy, weights = sampler.weights()
        counts = split(policy, list(weights.values()), SELECT_BATCH, rng)
        got = sessions.select({shard_of[s]: n for s, n in counts.items()})
        globalise(policy, weights, {s: (got[shard_of[s]].infos[3], got[shard_of[s]].infos[1],
                                        got[shard_of[s]].infos[2]) for s in counts})
        return sum(len(g) for g in got.values())

    # the floor under (a): every shard's Select of one pick at once, nothing else (the control plane's cost)
    for _ in range(5):
        sessions.select({shard_of[s]: 1 for s in shard_of})
    floor = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sessions.select({shard_of[s]: 1 for s in shard_of})
        floor.append(time.perf_counter() - t0)
    out["select_floor_us"] = float(np.median(floor)) * 1e6
    for fresh, key in ((True, "select_only_us"), (False, "select_only_cached_us")):
        for _ in range(5):
            select_once(fresh)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert select_once(fresh) == SELECT_BATCH
            times.append(time.perf_counter() - t0)
        out[key] = float(np.median(times)) * 1e6
        out[key.replace("_us", "_p90_us")] = float(np.percentile(times, 90)) * 1e6
    # (b) read ahead: Selects of several batches' picks per shard in flight, a batch taken from them
    def one_batch(ahead: _SelectAhead) -> None:
        counts = split(policy, list(weights.values()), SELECT_BATCH, rng)
        globalise(policy, weights, {s: ahead.take(shard_of[s], n) for s, n in counts.items()})

    for per_select in (1, 8):
        ahead = _SelectAhead(sessions, per_select * -(-SELECT_BATCH // len(addresses)), prefetch=2)
        for _ in range(2 * per_select):
            one_batch(ahead)
        n = max(reps, 4 * per_select)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            one_batch(ahead)
        out[f"select_ahead_{per_select}_us"] = (time.perf_counter() - t0) / n * 1e6
        out[f"select_ahead_{per_select}_cpu_us"] = (time.thread_time() - cpu0) / n * 1e6  # the learner's thread
        ahead.close()
    sessions.close()

    # (c) with collection, as a learner gets batches: sample() (one round trip per part), read ahead (batches())
    for _ in range(3):
        sampler.sample(SELECT_BATCH)
    total, weights_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        sampler.weights()
        t1 = time.perf_counter()
        batch = sampler.sample(SELECT_BATCH)
        t2 = time.perf_counter()
        assert len(batch) == SELECT_BATCH
        weights_s.append(t1 - t0)
        total.append(t2 - t1)
    kinds = sampler.kinds()
    # the split by masses at most 1 s old: one round trip less per batch
    cached = sharded_sampler(client, "p", client_type=reverb.Client, weights_max_age_s=1.0)
    for _ in range(3):
        cached.sample(SELECT_BATCH)
    cached_s = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cached.sample(SELECT_BATCH)
        cached_s.append(time.perf_counter() - t0)
    cached.close()
    # read ahead (what a dataset does for this table): batches cut from every shard's stream of picks
    streamed = client.sampler("p").batches(SELECT_BATCH)
    for _ in range(3):
        next(streamed)
    start = time.perf_counter()  # batches come in groups (one costly, the rest cut from it): the mean counts
    for _ in range(4 * reps):
        next(streamed)
    streamed_us = (time.perf_counter() - start) / (4 * reps) * 1e6
    streamed.close()
    client.close()
    out.update({"us_median": float(np.median(total)) * 1e6, "us_p90": float(np.percentile(total, 90)) * 1e6,
                "mass_query_us": float(np.median(weights_s)) * 1e6, "cached_split_us": float(np.median(cached_s)) * 1e6,
                "streamed_us": streamed_us, "planes": sorted(set(kinds.values()))})
    return out


# ---------------------------------------------------------------- driver --

def machine() -> str:
    cores = os.cpu_count()
    gpu = ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        gpu = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{platform.node()}: {cores} cores" + (f", {gpu}" if gpu else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "full": args.full, "device": args.device, "shards": {}}
    if args.device:
        from bench_planes import h2d_ceiling  # the pinned copy ceiling of this machine's GPU

        results["pcie_gbps"] = h2d_ceiling()
    planes = None if args.planes is None else args.planes.split(",")
    for n in args.shards:
        with tempfile.TemporaryDirectory(prefix="gear-bench-shards-") as tmp:
            daemons = Daemons(n, Path(tmp), max_size=args.items_per_shard, prio_items=0)
            try:
                r = {}
                if not args.no_insert:
                    r["insert"] = bench_insert(daemons.addresses, n * args.actors_per_shard, args.seconds)
                else:  # the learner reads what actors wrote: fill the tables without timing it
                    bench_insert(daemons.addresses, n, min(args.seconds, 2.0))
                r["pull"] = bench_pull(daemons.addresses, args.batch, args.seconds, planes, args.device)
            finally:
                daemons.stop()
        results["shards"][n] = r
        inserted = f"insert {r['insert']['gbps']:.3f} GB/s ({r['insert']['actors']} actors), " if "insert" in r else ""
        print(f"  {n} daemon(s): {inserted}pull {r['pull']['gbps']:.3f} GB/s, {r['pull']['ms_per_batch']:.1f} "
              f"ms/batch over {r['pull']['plane']}", flush=True)
    if args.prio_items > 0:
        with tempfile.TemporaryDirectory(prefix="gear-bench-shards-") as tmp:
            daemons = Daemons(SELECT_SHARDS, Path(tmp), max_size=16, prio_items=args.prio_items)
            try:
                results["select"] = bench_select(daemons.addresses, args.prio_items, args.select_reps)
            finally:
                daemons.stop()
    return results


def print_results(r: dict[str, Any]) -> None:
    print(f"\nsharding benchmark ({r['machine']}; {'full' if r['full'] else 'small'}, device={r['device']})")
    one = r["shards"].get(1)
    print(f"{'daemons':>8} {'insert GB/s':>12} {'x one':>7} {'goal':>6} {'pull GB/s':>10} {'ms/batch':>9} "
          f"{'+ms/shard':>10}  plane")
    for n, s in r["shards"].items():
        ins, pull = s["insert"]["gbps"] if "insert" in s else float("nan"), s["pull"]
        ratio = ins / one["insert"]["gbps"] if one and "insert" in one else float("nan")
        extra = (pull["ms_per_batch"] - one["pull"]["ms_per_batch"]) / (n - 1) if one and n > 1 else 0.0
        goal = GOALS["insert_scaling"] * n
        print(f"{n:>8} {ins:>12.3f} {ratio:>7.2f} {goal:>6.1f} {pull['gbps']:>10.3f} {pull['ms_per_batch']:>9.2f} "
              f"{extra:>10.2f}  {pull['plane']}")
    if r["device"]:
        best = min(s["pull"]["gbps"] for s in r["shards"].values())
        ceiling = r.get("pcie_gbps")
        where = "pinned H2D measured here" if ceiling else "H200 figure, not measured here"
        ceiling = ceiling or PCIE_GBPS
        print(f"learner pull, worst over shard counts: {best:.1f} GB/s = {best / ceiling:.2f} x PCIe "
              f"{ceiling:.1f} GB/s ({where}; goal >= {GOALS['pull_vs_pcie']})")
        for n, s in r["shards"].items():
            print(f"  {n} daemon(s): {s['pull']['gbps'] / ceiling:.2f} x PCIe")
    sel = r.get("select")
    if sel:
        print(f"prioritized selection of {SELECT_BATCH} over {SELECT_SHARDS} shards of {sel['items_per_shard']} items "
              f"(goal < {GOALS['select_us']:.0f} us; fill {sel['fill_s']:.0f} s):")
        print(f"  floor: a Select of one pick on every shard at once, {sel['select_floor_us']:.0f} us median (the "
              f"control plane's round trips alone)")
        print(f"  (a) selection alone, one batch: {sel['select_only_us']:.0f} us median "
              f"({sel['select_only_p90_us']:.0f} p90) with the masses asked; {sel['select_only_cached_us']:.0f} us "
              f"({sel['select_only_cached_p90_us']:.0f} p90) with masses reused")
        print(f"  (b) selection read ahead, per batch on the learner's path: {sel['select_ahead_1_us']:.0f} us "
              f"(one batch per Select), {sel['select_ahead_8_us']:.0f} us (8 batches per Select); the learner "
              f"thread's CPU {sel['select_ahead_1_cpu_us']:.0f} / {sel['select_ahead_8_cpu_us']:.0f} us a batch")
        print(f"  (c) with collection: sample() {sel['us_median']:.0f} us median ({sel['us_p90']:.0f} p90; mass query "
              f"alone {sel['mass_query_us']:.0f} us; masses <= 1 s old: {sel['cached_split_us']:.0f} us); read ahead "
              f"from the shards' streams: {sel['streamed_us']:.0f} us a batch; planes {'+'.join(sel['planes'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the GPU machine's sizes (B=256, 1M items per shard)")
    parser.add_argument("--device", default=None, help='"cuda": learner batches in GPU memory')
    parser.add_argument("--planes", default=None,
                        help='e.g. "inline" (default: inline when small, the best plane per shard with --full)')
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--actors-per-shard", type=int, default=None)
    parser.add_argument("--items-per-shard", type=int, default=None, help="table size per daemon (inserts, pull)")
    parser.add_argument("--prio-items", type=int, default=None, help="items per shard of the selection figure")
    parser.add_argument("--select-reps", type=int, default=50)
    parser.add_argument("--no-insert", action="store_true", help="skip the insert figure (tables filled untimed)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    full = args.full
    args.batch = args.batch or (256 if full else 32)
    args.seconds = args.seconds or (5.0 if full else 2.0)
    args.actors_per_shard = args.actors_per_shard or (2 if full else 1)
    args.items_per_shard = args.items_per_shard or (2048 if full else 256)
    args.prio_items = args.prio_items if args.prio_items is not None else (1_000_000 if full else 20_000)
    if args.planes is None and not full:
        args.planes = "inline"  # small: every shard's part over gRPC, to show what each shard adds
    r = run(args)
    print_results(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
