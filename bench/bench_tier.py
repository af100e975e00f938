"""Device tier benchmark (`make bench-tier-gpu`): a table mirrored in GPU memory, read at HBM speed.

A daemon (child process) serves table "t" (mirrored whole into GPU 0: ``gpu_mirror``) and "plain"
(the same, not mirrored), items of one 256 KiB float32 [64, 1024] step, each filled with one value
(the writer's sequence number), so a torn row shows as a row of two values. Measured in one run:

  1. learner on the mirror's GPU: gather of leased selections of B=256 (``DeviceTierReader.gather``,
     CUDA-event time) against the ceiling ``cupy.take`` of the same rows from a local device array;
     goal >= 500 GB/s. Also end to end (Selects of 4 batches sent ahead, Release folded in): the
     control plane's share.
  2. learner on another GPU (peer reads over NVLink), when there are two: the same gather against
     the peer-copy ceiling (cudaMemcpyPeer of 64 MiB); goal >= 250 GB/s.
  3. mirror upkeep's cost to inserts: one same-host writer's items/s into "t" against "plain",
     alternated; goal <= 10 %.
  4. torn items under churn: a writer process replaces items while the learner gathers; every row
     of every batch whose lease held is checked on the GPU (one value per row, equal to the
     segment's row); goal 0.

``--host``: the same run with the mirror's host stand-in and no GPU (checks the harness; its figures
are not the device tier's).
Usage: python3 bench/bench_tier.py [--items N] [--seconds S] [--host] [--json PATH] (JSON also to $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from gear_client.data_planes.device import DeviceTierReader  # noqa: E402
from gear_contract._proto import replay_pb2_grpc as pb_grpc  # noqa: E402

GOALS = {"same_gpu_gbs": 500.0, "peer_gpu_gbs": 250.0, "insert_cost": 0.10, "torn": 0}
STEPS, DIM = 64, 1024  # one step of float32 [64, 1024]: 256 KiB
ITEM_BYTES = STEPS * DIM * 4
BATCH = 256


# ------------------------------------------------------------------ daemon and writers --

def daemon_config(items: int, host: bool) -> str:
    backend = ', backend = "host"' if host else ""
    budget = (items + items // 8 + 64) * ITEM_BYTES  # every slot of the table (items + spare)
    tables = ""
    for name, mirror in (("t", True), ("plain", False)):
        tables += f"""
[[tables]]
name = "{name}"
max_size = {items}
sampler = "uniform"
remover = "fifo"
rate_limiter = {{ min_size = 1 }}
"""
        if mirror:
            tables += f"gpu_mirror = {{ device = 0, bytes = {budget}{backend} }}\n"
    return f'instance_name = "tier{uuid.uuid4().hex[:8]}"\nbind_address = "127.0.0.1"\nport = 0\n' + tables


class Daemon:
    """``python -m gear_server --config FILE`` in a child process; ready when it says so over sd_notify."""

    def __init__(self, config: str):
        self.folder = tempfile.mkdtemp(prefix="bench-tier-")
        path = os.path.join(self.folder, "gear.toml")
        with open(path, "w") as f:
            f.write(config)
        notify = os.path.join(self.folder, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(notify)
        self.log = open(os.path.join(self.folder, "daemon.log"), "wb")  # noqa: SIM115 - closed with the process
        env = {**os.environ, "NOTIFY_SOCKET": notify,
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.process = subprocess.Popen([sys.executable, "-m", "gear_server", "--config", path], env=env,
                                        stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)
        self.port = self._wait_ready()
        self.address = f"localhost:{self.port}"

    def _wait_ready(self) -> int:
        self.sock.settimeout(120)
        while True:
            try:
                message = self.sock.recv(65536).decode()
            except TimeoutError:
                raise SystemExit(f"the daemon did not start; log: {self.log.name}") from None
            found = re.search(r"on port (\d+)", message)
            if "READY=1" in message and found:
                return int(found.group(1))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.sock.close()
        self.log.close()


def write(address: str, table: str, first: int, count: int) -> float:
    """Items ``first .. first + count`` into ``table`` through a same-host TrajectoryWriter; items/s."""
    import gear_client as reverb

    client = reverb.Client(address)
    step = np.empty((STEPS, DIM), np.float32)
    with client.trajectory_writer(1) as w:
        t0 = time.perf_counter()
        for seq in range(first, first + count):
            step.fill(float(seq))
            w.append({"obs": step})
            w.create_item(table, 1.0, {"obs": w.history["obs"][-1:]})
        w.flush()
        return count / (time.perf_counter() - t0)


def churn(address: str, seconds: float, first: int) -> None:
    """A writer process: items into "t" for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        write(address, "t", first, 64)
        first += 64


# ------------------------------------------------------------------ measurements --

def gather_rate(reader: DeviceTierReader, selections: list, reps: int) -> float:
    """GB/s of gathering the leased ``selections`` (B items each), by CUDA events on the reader's GPU."""
    if not reader.on_gpu:
        t0 = time.perf_counter()
        for _ in range(reps):
            for s in selections:
                reader.gather(s)
        return reps * len(selections) * BATCH * reader.layout.columns[0].slot_stride / (time.perf_counter() - t0) / 1e9
    import cupy as cp

    with cp.cuda.Device(reader.device):
        out = cp.empty((BATCH, reader.layout.columns[0].slot_stride), cp.uint8)
        for s in selections[:2]:
            reader.gather(s, out)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            for s in selections:
                reader.gather(s, out)
        end.record()
        end.synchronize()
        seconds = cp.cuda.get_elapsed_time(start, end) / 1e3
    return reps * len(selections) * out.nbytes / seconds / 1e9


def take_ceiling(device: int, rows: int, row_bytes: int, indices: list[np.ndarray], reps: int) -> float:
    """GB/s of ``cupy.take`` of the same row indices from a local [rows, row_bytes] device array (8-byte words,
    as the reader moves them)."""
    import cupy as cp

    with cp.cuda.Device(device):
        table = cp.ones((rows, row_bytes // 8), cp.uint64)
        out = cp.empty((BATCH, row_bytes // 8), cp.uint64)
        idx = [cp.asarray(i) for i in indices]
        for i in idx[:2]:
            cp.take(table, i, axis=0, out=out)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            for i in idx:
                cp.take(table, i, axis=0, out=out)
        end.record()
        end.synchronize()
        seconds = cp.cuda.get_elapsed_time(start, end) / 1e3
        del table
    return reps * len(idx) * out.nbytes / seconds / 1e9


def peer_ceiling(src: int, dst: int) -> float:
    """GB/s of a 64 MiB cudaMemcpyPeer from GPU ``src`` to GPU ``dst`` (best of five)."""
    import cupy as cp

    n = 64 << 20
    with cp.cuda.Device(src):
        a = cp.ones(n, cp.uint8)
    with cp.cuda.Device(dst):
        b = cp.empty(n, cp.uint8)
        best = 0.0
        for _ in range(6):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            cp.cuda.runtime.memcpyPeer(b.data.ptr, dst, a.data.ptr, src, n)
            end.record()
            end.synchronize()
            best = max(best, n / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9)
    return best


def leased(reader: DeviceTierReader, count: int) -> list:
    return [reader.select(BATCH) for _ in range(count)]


def wait_mirrored(address: str, items: int, timeout: float = 120.0) -> float:
    """Seconds until the mirror holds every item of "t" (server_info), measured from the call."""
    import gear_client as reverb

    client = reverb.Client(address)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if client.server_info()["t"].gpu_mirror.mirrored_items >= items:
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise SystemExit(f"the mirror did not fill within {timeout} s: {client.server_info()['t'].gpu_mirror}")


def learner_gather(address: str, device: int | None, count: int, reps: int) -> dict[str, Any]:
    """Gather GB/s of ``count`` leased selections on GPU ``device``, with the take ceiling there."""
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(address))
    with DeviceTierReader(stub, "t", device=device) as reader:
        selections = leased(reader, count)
        mirrored = float(np.mean([np.mean(s.mirror_rows >= 0) for s in selections]))
        rate = gather_rate(reader, selections, reps)
        for s in selections:
            reader.release(s)
        row = reader.layout.columns[0].slot_stride
        ceiling = take_ceiling(reader.device, reader.layout.capacity, row,
                               [s.mirror_rows for s in selections], reps) if reader.on_gpu else None
    return {"gbs": rate, "take_ceiling_gbs": ceiling, "mirrored_fraction": mirrored}


def learner_end_to_end(address: str, device: int | None, seconds: float, per_select: int = 4,
                       ahead: int = 2) -> dict[str, Any]:
    """Batches of B gathered from Selects of ``per_select`` batches, ``ahead`` Selects in flight (GB/s)."""
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(address))
    with DeviceTierReader(stub, "t", device=device) as reader:
        sync = gpu_sync(reader.device) if reader.on_gpu else (lambda: None)
        pending = [reader.select_async(BATCH * per_select) for _ in range(ahead)]
        done = 0
        release: list[int] = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            selection, _ = pending.pop(0).result()
            selection = reader.accept(selection)
            batch = reader.gather(selection)
            sync()
            done += batch.nbytes
            release = [selection.lease_id]
            pending.append(reader.select_async(BATCH * per_select, release))
        elapsed = time.perf_counter() - t0
        for p in pending:
            selection, _ = p.result()
            reader.release(selection)
    return {"gbs": done / elapsed / 1e9, "items_per_select": BATCH * per_select}


def gpu_sync(device: int):
    import cupy as cp

    return cp.cuda.Device(device).synchronize


def torn_under_churn(address: str, device: int | None, seconds: float) -> dict[str, Any]:
    """Rows of leased, still-good batches that are not one value, or differ from the segment's row."""
    writer = multiprocessing.get_context("spawn").Process(target=churn, args=(address, seconds + 2, 10_000_000))
    writer.start()
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(address))
    torn = rows = mirrored = stale = 0
    try:
        with DeviceTierReader(stub, "t", device=device) as reader:
            xp = __import__("cupy") if reader.on_gpu else np
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                selection = reader.select(BATCH)
                batch = reader.gather(selection)
                values = batch.view(xp.float32)
                bad = (~(values == values[:, :1]).all(axis=1)
                       | (batch != reader.segment_rows(selection.slots)).any(axis=1))
                count = int(bad.sum())
                if reader.release(selection):
                    torn += count
                    rows += len(selection)
                    mirrored += int((selection.mirror_rows >= 0).sum())
                else:
                    stale += 1
    finally:
        writer.join(seconds + 60)
    return {"torn": torn, "rows_checked": rows, "mirrored_rows": mirrored, "stale_batches": stale}


def machine() -> str:
    gpu = ""
    try:
        import cupy as cp

        props = cp.cuda.runtime.getDeviceProperties(0)
        gpu = f", {cp.cuda.runtime.getDeviceCount()} x {props['name'].decode()}"
    except Exception:  # noqa: BLE001
        pass
    return f"{platform.machine()}, {os.cpu_count()} CPUs{gpu}, Python {platform.python_version()}"


def gpu_count() -> int:
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=4096, help="table size (items of 256 KiB)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--host", action="store_true", help="the mirror's host stand-in (no GPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gpus = 0 if args.host else gpu_count()
    if not args.host and gpus == 0:
        raise SystemExit("no CUDA GPU (CuPy): run on the GPU machine, or --host to check the harness")
    results: dict[str, Any] = {"machine": machine(), "date": datetime.date.today().isoformat(),
                               "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                               "goals": GOALS, "item_bytes": ITEM_BYTES, "batch": BATCH, "items": args.items,
                               "host": args.host}
    daemon = Daemon(daemon_config(args.items, args.host))
    try:
        for table in ("t", "plain"):
            write(daemon.address, table, 0, args.items)
        results["mirror_filled_s"] = wait_mirrored(daemon.address, args.items)
        device = None if args.host else 0
        results["same_gpu"] = learner_gather(daemon.address, device, 16, 5)
        results["same_gpu_end_to_end"] = learner_end_to_end(daemon.address, device, args.seconds)
        if gpus >= 2:
            results["peer_gpu"] = learner_gather(daemon.address, 1, 16, 5)
            results["peer_gpu"]["peer_copy_ceiling_gbs"] = peer_ceiling(0, 1)
        rates = {"t": [], "plain": []}
        first = args.items
        for _ in range(3):
            for table in ("plain", "t"):
                rates[table].append(write(daemon.address, table, first, 1024))
                first += 1024
        with_mirror, without = max(rates["t"]), max(rates["plain"])
        results["inserts"] = {"mirrored_items_per_s": with_mirror, "plain_items_per_s": without,
                              "cost": max(0.0, 1 - with_mirror / without)}
        results["churn"] = torn_under_churn(daemon.address, device, args.seconds)
    finally:
        daemon.stop()
    report(results)
    text = json.dumps(results, indent=2)
    for path in filter(None, (args.json, os.path.join(os.environ["OUT"], "bench_tier.json")
                              if os.environ.get("OUT") else None)):
        with open(path, "w") as f:
            f.write(text)


def report(r: dict[str, Any]) -> None:
    print(f"device tier, {r['machine']}, {r['date']}: B={BATCH}, items of {ITEM_BYTES >> 10} KiB, "
          f"table of {r['items']}; mirror filled {r['mirror_filled_s']:.1f} s after the inserts")
    if r["host"]:
        print("  (--host: the mirror's host stand-in, no GPU; these figures check the harness, not the device tier)")
    same = r["same_gpu"]
    ceiling = same["take_ceiling_gbs"]
    print(f"  same GPU gather      {same['gbs']:8.1f} GB/s  goal >= {GOALS['same_gpu_gbs']:.0f}"
          + (f"  ceiling (cupy.take on-device) {ceiling:.1f} GB/s = {same['gbs'] / ceiling:.0%}" if ceiling else "")
          + f"  mirrored {same['mirrored_fraction']:.0%}")
    e2e = r["same_gpu_end_to_end"]
    print(f"  same GPU end to end  {e2e['gbs']:8.1f} GB/s  (Selects of {e2e['items_per_select']} items, 2 ahead)")
    if "peer_gpu" in r:
        peer = r["peer_gpu"]
        print(f"  peer GPU gather      {peer['gbs']:8.1f} GB/s  goal >= {GOALS['peer_gpu_gbs']:.0f}"
              f"  ceiling (peer copy) {peer['peer_copy_ceiling_gbs']:.1f} GB/s"
              f" = {peer['gbs'] / peer['peer_copy_ceiling_gbs']:.0%}")
    else:
        print("  peer GPU gather      not measured (one GPU)")
    ins = r["inserts"]
    print(f"  inserts              {ins['mirrored_items_per_s']:8.0f} items/s mirrored vs "
          f"{ins['plain_items_per_s']:.0f} plain: cost {ins['cost']:.1%}  goal <= {GOALS['insert_cost']:.0%}")
    c = r["churn"]
    print(f"  torn under churn     {c['torn']} of {c['rows_checked']} rows ({c['mirrored_rows']} from the mirror, "
          f"{c['stale_batches']} stale batches)  goal {GOALS['torn']}")


if __name__ == "__main__":
    main()
