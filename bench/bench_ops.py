"""Operations benchmark: checkpoint write and restore, metrics and token-check overheads.

* Checkpoint: a table of ``--gib`` GiB (items of 256 KiB) is written with
  ``Checkpointer.write`` (snapshot, SHA-256, fsync, rename) and restored with
  ``load_latest`` + ``Table.restore``, into ``--dir`` (default: a temporary
  folder on the root disk). Ceiling: the same bytes written sequentially with
  one fsync (``dd``-like), and read back, on the same disk; and SHA-256 alone.
* Metrics: nanoseconds per hot-path update (one insert counted; one inline
  sample counted with its two latency observations; one finished RPC counted
  with its label bounding). Ceiling: a bare dict update, the least any counter
  costs in Python. Goal for the bounded labels: /metrics grows by at most a
  few series (not one per name) after 10,000 RPCs to made-up methods.
* Token check: microseconds per unary RPC on loopback with the bearer-token
  interceptor and RPC counting against the same server without them.

    .venv/bin/python bench/bench_ops.py [--gib 1] [--dir /var/lib/gear]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from concurrent import futures

import grpc
import numpy as np

from gear_client.connection.auth import ChannelSecurity
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.checkpoint.checkpointer import Checkpointer
from gear_server.daemon_ops import restore_table, table_state
from gear_server.ops.auth import AuthSettings
from gear_server.ops.metrics import RpcObserver, ServerMetrics
from gear_server.storage import SegmentStore
from gear_server.table.table import ItemToInsert, Table

ITEM_BYTES = 256 << 10
GB = 1e9


def _fill(store: SegmentStore, gib: float) -> Table:
    n = int(gib * (1 << 30) // ITEM_BYTES)
    config = pb.TableConfig(name="bench", sampler=pb.SelectorOptions(uniform=True),
                            remover=pb.SelectorOptions(fifo=True), max_size=n,
                            rate_limiter=pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1,
                                                               min_diff=-1e308, max_diff=1e308))
    table = Table(config, store, seed=0)
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 255, size=(64, ITEM_BYTES // 64), dtype=np.uint8)
    structure = pb.Structure()
    for key in range(n):
        table.insert(ItemToInsert(key=key + 1, priority=1.0, structure=structure, columns=[obs], squeeze=[False]))
    return table


def _raw_disk(folder: str, nbytes: int) -> tuple[float, float]:
    """GB/s of one sequential write (+fsync) and read of ``nbytes`` in 64 MiB blocks."""
    path = os.path.join(folder, "raw.bin")
    block = np.random.default_rng(1).integers(0, 255, size=64 << 20, dtype=np.uint8).tobytes()
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = os.path.getsize(path) / (time.perf_counter() - started) / GB
    _drop_cache(folder)
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    read = os.path.getsize(path) / (time.perf_counter() - started) / GB
    os.unlink(path)
    return write, read


def _drop_cache(folder) -> None:
    """Ask the kernel to forget the cached pages of every file under ``folder`` (written back first)."""
    os.sync()
    for dirpath, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_checkpoint(gib: float, folder: str) -> dict:
    store = SegmentStore("/dev/shm", f"bench{uuid.uuid4().hex[:8]}")
    root = tempfile.mkdtemp(prefix="gear-bench-ckpt-", dir=folder)
    try:
        table = _fill(store, gib)
        nbytes = table.size() * ITEM_BYTES
        ckpt = Checkpointer(root, keep=1)
        started = time.perf_counter()
        states = [table_state(table)]  # the copy taken under the table's lock
        snapshot_s = time.perf_counter() - started
        path = ckpt.write(states)
        write_s = time.perf_counter() - started
        del states
        items = table.size()
        table.close()
        _drop_cache(path)  # read from the disk, not the page cache
        started = time.perf_counter()
        _, states = ckpt.load_latest()
        load_s = time.perf_counter() - started
        copy = Table(states[0].config, store)
        restore_table(copy, states[0])
        restore_s = time.perf_counter() - started
        assert copy.size() == items
        copy.close()
        shutil.rmtree(path)
        raw_write, raw_read = _raw_disk(root, nbytes)
        data = np.ones(256 << 20, np.uint8)
        started = time.perf_counter()
        hashlib.sha256(data).digest()
        sha = data.nbytes / (time.perf_counter() - started) / GB
        return {"table_gb": nbytes / GB, "write_gbps": nbytes / write_s / GB, "write_s": write_s,
                "snapshot_s": snapshot_s, "restore_gbps": nbytes / restore_s / GB, "restore_s": restore_s,
                "load_s": load_s,
                "ceiling_disk_write_gbps": raw_write, "ceiling_disk_read_gbps": raw_read, "sha256_gbps": sha}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        store.close()


def bench_metrics(n: int = 200_000) -> dict:
    metrics = ServerMetrics()
    columns = [np.zeros(16, np.float32)]
    started = time.perf_counter()
    for _ in range(n):
        metrics.item_inserted("replay", columns)
    insert_ns = (time.perf_counter() - started) / n * 1e9
    started = time.perf_counter()
    for _ in range(n):
        metrics.sample_served("replay", 32, 1 << 20, 1e-4, 2e-3)
    sample_ns = (time.perf_counter() - started) / n * 1e9
    started = time.perf_counter()
    for _ in range(n):
        metrics.observe_rpc("/gear.v1.ReplayService/Sample", "OK", 1e-3)
    rpc_ns = (time.perf_counter() - started) / n * 1e9
    counts: dict = {}
    started = time.perf_counter()
    for _ in range(n):
        counts["replay"] = counts.get("replay", 0) + 1
    floor_ns = (time.perf_counter() - started) / n * 1e9
    before = len(metrics.render())
    for i in range(10_000):
        metrics.observe_rpc(f"/gear.v1.ReplayService/MadeUp{i}", "UNAUTHENTICATED", 1e-4)
        metrics.auth_denied(f"/gear.v1.ReplayService/MadeUp{i}")
    return {"insert_update_ns": insert_ns, "sample_update_ns": sample_ns, "rpc_update_ns": rpc_ns,
            "ceiling_dict_update_ns": floor_ns, "metrics_bytes": before,
            "metrics_growth_bytes_after_10k_made_up_methods": len(metrics.render()) - before}


class _Info(pb_grpc.ReplayServiceServicer):
    def ServerInfo(self, request, context):  # noqa: N802
        return pb.ServerInfoResponse(version="bench")


def _rpc_us(interceptors, metadata_token: str | None, n: int) -> float:
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=interceptors)
    pb_grpc.add_ReplayServiceServicer_to_server(_Info(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with ChannelSecurity.build(token=metadata_token, use_env=False).channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ReplayServiceStub(channel)
            for _ in range(200):
                stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
            started = time.perf_counter()
            for _ in range(n):
                stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
            return (time.perf_counter() - started) / n * 1e6
    finally:
        server.stop(None)


def bench_auth(n: int = 3000) -> dict:
    plain = _rpc_us([], None, n)
    guarded = _rpc_us([RpcObserver(ServerMetrics()), *AuthSettings(token="bench-token").interceptors()],
                      "bench-token", n)
    return {"rpc_us_plain": plain, "rpc_us_token_and_counting": guarded, "overhead_us": guarded - plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="table size to checkpoint (GiB)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp folder)")
    args = parser.parse_args()
    folder = args.dir or tempfile.gettempdir()
    results = {"checkpoint": bench_checkpoint(args.gib, folder), "metrics": bench_metrics(),
               "auth": bench_auth()}
    c, m, a = results["checkpoint"], results["metrics"], results["auth"]
    print(f"checkpoint of {c['table_gb']:.2f} GB in {folder}:")
    print(f"  write   {c['write_gbps']:.2f} GB/s ({c['write_s']:.2f} s, of which snapshot {c['snapshot_s']:.2f} s)"
          f"   ceiling: disk write+fsync "
          f"{c['ceiling_disk_write_gbps']:.2f} GB/s, SHA-256 {c['sha256_gbps']:.2f} GB/s")
    print(f"  restore {c['restore_gbps']:.2f} GB/s ({c['restore_s']:.2f} s, of which reading+checking "
          f"{c['load_s']:.2f} s)   ceiling: disk read "
          f"{c['ceiling_disk_read_gbps']:.2f} GB/s, SHA-256 {c['sha256_gbps']:.2f} GB/s")
    print(f"metrics per update: insert {m['insert_update_ns']:.0f} ns, inline sample {m['sample_update_ns']:.0f} ns, "
          f"finished RPC {m['rpc_update_ns']:.0f} ns   ceiling: a dict update {m['ceiling_dict_update_ns']:.0f} ns")
    print(f"/metrics: {m['metrics_bytes']} bytes, +{m['metrics_growth_bytes_after_10k_made_up_methods']} after 10,000 "
          f"RPCs to made-up methods (goal: a few series, not one per name)")
    print(f"unary RPC on loopback: {a['rpc_us_plain']:.0f} us plain, {a['rpc_us_token_and_counting']:.0f} us with "
          f"token check + RPC counting (+{a['overhead_us']:.0f} us)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
