"""The nixl plane's learner against the TCP ceiling of the same link (and the stream plane beside it).

Links, each measured in the same run (``bench_remote``'s): ``veth`` (the daemon on
the host side of a veth pair, the learner in another network namespace; root and
ip(8)) and ``loopback``. There is no RDMA device on the machines this runs on, so
UCX moves the bytes over its TCP transport (UCX_TLS=tcp, UCX_NET_DEVICES the link's
interface): the figures say what NIXL's TCP path gives, not what RDMA would.

Per link:

* **TCP ceiling**: ``bench_remote.tcp_ceiling`` (sendfile of random 256 KiB windows
  to recv_into) on 1 and 4 connections, measured again just before each learner;
* **nixl learner**: ``PlaneSampler.batches(B)`` over the nixl plane (one NIXL READ a
  batch, a descriptor list of the leased windows, into a registered host buffer;
  with ``--device cuda`` into GPU memory registered as VRAM) for B = 32 and 256
  items of 256.8 KiB;
* **stream learner**: the same over the stream plane with 4 connections, for scale.

No goal: without an RDMA device the nixl plane's speed is UCX's TCP transport's,
reported against the ceiling. Figures are GB/s of item payload (10^9 bytes/s).

Usage: python bench/bench_nixl.py [--links veth loopback] [--batches 32 256] [--seconds 3]
       [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_remote as remote  # noqa: E402 - bench/ is put on the path just above

_LEARNER = r"""
import json, sys, time
from gear_client.data_planes.sampler import PlaneSampler
address, batch, seconds, plane, device, item_bytes = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
                                                      sys.argv[4], sys.argv[5], int(sys.argv[6]))
gpu = device != "none"
s = PlaneSampler(address, "t", host_id="bench-nixl-learner", planes=[plane, "inline"], stream_connections=4,
                 device=device if gpu else None)
kind = s.open()
items, started, warm = 0, None, 0
for b in s.batches(batch):
    if gpu:
        import cupy as cp
        cp.cuda.get_current_stream().synchronize()
    if started is None:
        warm += 1
        if warm == 3:
            started = time.perf_counter()
        continue
    items += len(b)
    if time.perf_counter() - started > seconds:
        break
elapsed = time.perf_counter() - started
transfers = getattr(s._reader, "transfers", None)
stale = s.stale_batches
s.close()
print(json.dumps({"kind": kind, "gbps": items * item_bytes / elapsed / 1e9, "items": items, "stale": stale,
                  "transfers": transfers}))
"""


def learner(address: str, far: list[str], env: dict[str, str], batch: int, seconds: float, plane: str,
            device: str | None) -> dict:
    out = subprocess.run([*far, sys.executable, "-c", _LEARNER, address, str(batch), str(seconds), plane,
                          device or "none", str(remote.ITEM_BYTES)], capture_output=True, text=True,
                         timeout=seconds + 120, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(link: str, args: argparse.Namespace) -> dict[str, Any]:
    opener = remote.veth_link if link == "veth" else remote.loopback_link
    host_if, far_if = (remote.veth_names()[1:]) if link == "veth" else ("lo", "lo")
    result: dict[str, Any] = {"ceiling": {}, "learner": {}}
    with opener() as (host, far):
        for conns in (1, 4):
            result["ceiling"][conns] = remote.tcp_ceiling(host, far, conns, args.seconds)
            print(f"  [{link}] TCP ceiling, {conns} connection(s): {result['ceiling'][conns]:.2f} GB/s", flush=True)
        os.environ.update(UCX_TLS=args.ucx_tls, UCX_NET_DEVICES=host_if)  # the daemon's agent, in this process
        daemon = remote.start_daemon(host, args.items)
        env = dict(remote._env(), UCX_TLS=args.ucx_tls, UCX_NET_DEVICES=far_if)
        try:
            report = daemon.service.data_planes.report
            if "nixl" not in report.offered:
                raise RuntimeError(f"the daemon offers no nixl plane: {report.line()}")
            address = f"{host}:{daemon.port}"
            for device in [None] + (["cuda"] if args.device == "cuda" else []):
                for plane in ("nixl", "stream"):
                    for batch in args.batches:
                        conns = 1 if plane == "nixl" else 4
                        r = {"ceiling": remote.tcp_ceiling(host, far, conns, args.seconds)}
                        r.update(learner(address, far, env, batch, args.seconds, plane, device))
                        r["ratio"] = r["gbps"] / r["ceiling"]
                        key = f"{plane} B={batch}" + (" cuda" if device else "")
                        result["learner"][key] = r
                        print(f"  [{link}] {key} (opened {r['kind']}): {r['gbps']:.2f} GB/s = {r['ratio']:.2f}x the "
                              f"{conns}-connection ceiling of {r['ceiling']:.2f} just before (stale {r['stale']}, "
                              f"READs {r['transfers']})", flush=True)
        finally:
            daemon.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    can_veth = os.geteuid() == 0 and shutil.which("ip") is not None
    parser.add_argument("--links", nargs="+", choices=("veth", "loopback"),
                        default=["veth", "loopback"] if can_veth else ["loopback"])
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 256])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--items", type=int, default=1024, help="items in the table (256.8 KiB each)")
    parser.add_argument("--device", choices=("cuda",), default=None)
    parser.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for both agents (add cuda_copy for --device)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from gear_contract import nixl_agents

    reason = nixl_agents.unavailable_reason()
    if reason is not None:
        print(f"bench_nixl: {reason}; run it in .venv-nixl (make bench-nixl)", file=sys.stderr)
        return 2
    print(f"bench_nixl: {platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"; items of {remote.ITEM_BYTES} bytes; {args.seconds:g} s per figure; UCX_TLS={args.ucx_tls}", flush=True)
    results = {}
    for link in args.links:
        with contextlib.suppress(KeyboardInterrupt):
            results[link] = measure(link, args)
    print("\n== nixl plane (no goal without an RDMA device: UCX's TCP transport) ==")
    for link, r in results.items():
        for key, lr in r["learner"].items():
            print(f"[{link}] {key}: {lr['gbps']:.2f} GB/s = {lr['ratio']:.2f}x ceiling {lr['ceiling']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
