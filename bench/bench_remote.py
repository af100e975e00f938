"""Remote learners and actors over TCP: gear's stream plane against the TCP ceiling of the same link.

Links, each measured in the same run:

* ``veth``: the daemon on the host side of a veth pair, learners and actors in
  another network namespace (another host as far as gear can tell); needs root
  and ip(8);
* ``loopback``: both on 127.0.0.1, the learner claiming another host identity.

Per link:

* **TCP ceiling**: a sender process ``os.sendfile``-s random 256 KiB windows of a
  /dev/shm file on 1, 2 and 4 connections; a receiver process on the far side
  ``recv_into``-s one preallocated buffer per connection (a thread each);
* **learner**: ``PlaneSampler.batches(B)`` over the stream plane (pipelined: Selects
  sent ahead, windows received on the session's connections straight into the batch
  buffer) for B = 32 and 256 items of 256.8 KiB (64 steps of {obs: float32[1024],
  action: int64, reward: float32}) from a Uniform table, into host memory, and
  with ``--device cuda`` copied on into GPU memory (pinned buffers); with 1 and 4
  connections, each against the ceiling with as many connections measured just
  before it (the machine's load drifts; the first ceilings are printed too);
* **actors**: one and eight actor processes on the far side writing 256.8 KiB items
  with ``TrajectoryWriter``: over the stream plane (slots reserved and committed over
  gRPC, rows on a stream connection received into the segment), and for comparison
  over InsertStream to the ingest workers (``GEAR_INSERT_STREAM=0``); and "stream
  rows": the insert plane's ``SlotWriter`` alone writing prepared items over the stream
  (reserve, rows on the connection, commit: the plane without TrajectoryWriter's
  per-step Python work, which the goal is checked on); each against one
  connection's ceiling measured just before.

Goals printed: learner >= 0.8x the ceiling with the same number of connections;
one remote actor >= 0.8x one connection's ceiling. Figures are GB/s of item payload
(10^9 bytes per second).

Usage: python bench/bench_remote.py [--links veth loopback] [--batches 32 256] [--seconds 3]
       [--device cuda] [--no-actors | --no-learner] [--json PATH]
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS, OBS_DIM = 64, 1024
ITEM_BYTES = STEPS * (OBS_DIM * 4 + 8 + 4)
WINDOW = 256 << 10
GOAL_LEARNER = 0.8
GOAL_ACTOR = 0.8

_SENDER = r"""
import os, random, socket, sys, threading
path, conns = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
lst = socket.create_server((sys.argv[3], 0))
print(lst.getsockname()[1], flush=True)
def serve(c):
    rnd = random.Random(c.fileno())
    try:
        while True:
            off = rnd.randrange(0, size // 262144) * 262144
            n = 262144
            while n:
                sent = os.sendfile(c.fileno(), fd, off, n)
                off += sent; n -= sent
    except OSError:
        pass
    finally:
        c.close()
threads = []
for _ in range(conns):
    c, _ = lst.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = threading.Thread(target=serve, args=(c,)); t.start(); threads.append(t)
for t in threads:
    t.join()
"""

_RECEIVER = r"""
import json, socket, sys, threading, time
host, port, conns, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
socks = [socket.create_connection((host, port)) for _ in range(conns)]
counts = [0] * conns
start = threading.Barrier(conns + 1)
window = [0.0, 0.0]
def recv(i):
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    s = socks[i]
    start.wait()
    end = window[1]
    while time.monotonic() < end:
        n = s.recv_into(view)
        if not n:
            break
        counts[i] += n
threads = [threading.Thread(target=recv, args=(i,)) for i in range(conns)]
for t in threads:
    t.start()
time.sleep(0.3)
window[0] = time.monotonic(); window[1] = window[0] + seconds
start.wait()
for t in threads:
    t.join()
elapsed = time.monotonic() - window[0]
for s in socks:
    s.close()
print(json.dumps({"gbps": sum(counts) / elapsed / 1e9}))
"""

_LEARNER = r"""
import json, sys, time
from gear_client.data_planes.sampler import PlaneSampler
address, batch, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conns, device = int(sys.argv[4]), sys.argv[5]
item_bytes = int(sys.argv[6])
gpu = device != "none"
if gpu:
    import cupy as cp
s = PlaneSampler(address, "t", host_id="bench-remote-learner", stream_connections=conns,
                 device=device if gpu else None)
kind = s.open()
items = 0
started = None
warm = 0
for b in s.batches(batch):
    if gpu:
        cols = [cp.asarray(c) for c in b.columns]
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
stale = s.stale_batches
s.close()
print(json.dumps({"kind": kind, "gbps": items * item_bytes / elapsed / 1e9, "items": items, "stale": stale}))
"""

_ROWS_ACTOR = r"""
import json, sys, time
import grpc
import numpy as np
from gear_contract import nest
from gear_contract.slot_writer import SlotWriter
address, items, stream = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
rng = np.random.default_rng(0)
cols = [np.arange(64, dtype=np.int64), rng.standard_normal((64, 1024), dtype=np.float32), np.ones(64, np.float32)]
specs = [(c.dtype, c.shape[1:], False) for c in cols]
structure = nest.structure_of({"obs": 0, "action": 0, "reward": 0}).SerializeToString()
w = SlotWriter(grpc.insecure_channel(address), reserve_ahead=32,
               stream_host=address.rpartition(":")[0] if stream else None)
assert w.fits("t", specs, [64, 64, 64], structure)
key = 10 ** 9
for _ in range(4):
    key += 1; w.write("t", key, 1.0, [[c] for c in cols], [64, 64, 64])
w.wait(0)
print("ready", flush=True)
sys.stdin.readline()
t, cpu = time.perf_counter(), time.process_time()
for _ in range(items):
    key += 1
    w.wait(63)
    w.write("t", key, 1.0, [[c] for c in cols], [64, 64, 64])
w.wait(0)
elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
w.close()
print(json.dumps({"seconds": elapsed, "cpu": cpu}))
"""

_ACTOR = r"""
import json, sys, time
import numpy as np
import gear_client as reverb
address, items = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
step = {"obs": rng.standard_normal(1024, dtype=np.float32), "action": np.int64(1), "reward": np.float32(0.5)}
client = reverb.Client(address)
with client.trajectory_writer(64) as w:
    def one():
        for _ in range(64):
            w.append(step)
        w.create_item("t", 1.0, {k: w.history[k][-64:] for k in step})
        w.end_episode()
    for _ in range(4):
        one()
    w.flush()
    print("ready", flush=True)
    sys.stdin.readline()
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(items):
        one()
    w.flush()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
print(json.dumps({"seconds": elapsed, "cpu": cpu}))
"""


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


def veth_names() -> tuple[str, str, str]:
    """(namespace, host-side interface, namespace-side interface) of this process's ``veth_link``."""
    tag = os.getpid() % 100000
    return f"gearbr{tag}", f"gb{tag}a", f"gb{tag}b"


@contextlib.contextmanager
def veth_link() -> Iterator[tuple[str, list[str]]]:
    """(daemon address, command prefix that runs a process on the far side) of a veth pair into a namespace."""
    tag = os.getpid() % 100000
    ns, host_if, ns_if = veth_names()
    net = f"10.{150 + tag % 50}.{tag % 250}"
    host_ip, ns_ip = f"{net}.1", f"{net}.2"
    setup = [("ip", "netns", "add", ns), ("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if),
             ("ip", "link", "set", ns_if, "netns", ns), ("ip", "addr", "add", f"{host_ip}/30", "dev", host_if),
             ("ip", "link", "set", host_if, "up"),
             ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if),
             ("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"),
             ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")]
    try:
        for cmd in setup:
            done = _run(*cmd)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        yield host_ip, ["ip", "netns", "exec", ns]
    finally:
        _run("ip", "link", "del", host_if)
        _run("ip", "netns", "del", ns)


@contextlib.contextmanager
def loopback_link() -> Iterator[tuple[str, list[str]]]:
    yield "127.0.0.1", []


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GEAR_HOST_ID", None)
    return env


def tcp_ceiling(host: str, far: list[str], conns: int, seconds: float) -> float:
    """GB/s of sendfile (random 256 KiB windows of a /dev/shm file) to recv_into on ``conns`` connections."""
    path = f"/dev/shm/gear-bench-remote-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, 256 * WINDOW, dtype=np.uint8).tobytes())
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, path, str(conns), host], stdout=subprocess.PIPE,
                              text=True)
    try:
        port = sender.stdout.readline().strip()
        out = subprocess.run([*far, sys.executable, "-c", _RECEIVER, host, port, str(conns), str(seconds)],
                             capture_output=True, text=True, timeout=seconds + 60)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return json.loads(out.stdout.strip().splitlines()[-1])["gbps"]
    finally:
        try:
            sender.wait(timeout=10)  # its connections closed: it ends
        except subprocess.TimeoutExpired:
            sender.kill()
            sender.wait()
        os.unlink(path)


def start_daemon(host: str, num_items: int):
    """A daemon on ``host`` with table "t" (Uniform, ``num_items`` items of 256.8 KiB), in this process."""
    from gear_contract import nest
    from gear_contract._proto import replay_pb2 as pb
    from gear_server.config import DaemonSettings
    from gear_server.daemon import Daemon
    from gear_server.ops.auth import AuthSettings
    from gear_server.table.table import ItemToInsert

    limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-sys.float_info.max,
                                    max_diff=sys.float_info.max)
    table = pb.TableConfig(name="t", max_size=num_items, sampler=pb.SelectorOptions(uniform=True),
                           remover=pb.SelectorOptions(fifo=True), rate_limiter=limiter)
    settings = DaemonSettings.from_server_config(
        pb.ServerConfig(port=0, bind_address=host, instance_name=f"benchremote{os.getpid()}", tables=[table]))
    settings.auth = AuthSettings(allow_insecure=True)  # a link between this host's own namespaces, no credentials
    daemon = Daemon(settings)
    daemon.start()
    structure = nest.structure_of({"obs": 0, "action": 0, "reward": 0})
    rng = np.random.default_rng(1)
    obs = rng.standard_normal((STEPS, OBS_DIM), dtype=np.float32)
    for key in range(num_items):
        daemon.tables["t"].insert(ItemToInsert(key=key + 1, priority=1.0, structure=structure,
                                               columns=[np.arange(STEPS, dtype=np.int64), obs,
                                                        np.ones(STEPS, dtype=np.float32)], squeeze=[False] * 3))
    return daemon


def learner(address: str, far: list[str], batch: int, seconds: float, conns: int, device: str | None) -> dict:
    out = subprocess.run([*far, sys.executable, "-c", _LEARNER, address, str(batch), str(seconds), str(conns),
                          device or "none", str(ITEM_BYTES)], capture_output=True, text=True, timeout=seconds + 120,
                         env=_env(), cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def actors(address: str, far: list[str], count: int, items: int, stream: bool, rows_only: bool = False) -> dict:
    """GB/s of ``count`` actor processes each writing ``items`` items, started together (``stream``: rows over
    the stream plane; else InsertStream to the ingest workers, ``GEAR_INSERT_STREAM=0``). ``rows_only``: the
    insert plane's SlotWriter writing prepared items (the plane alone, without TrajectoryWriter's per-step work).
    Also the CPU time per item of an actor and of the daemon (this process) while they wrote: on a loaded host
    the CPU each item costs bounds the rate."""
    env = dict(_env(), GEAR_HOST_ID="bench-remote-actor", GEAR_INSERT_STREAM="1" if stream else "0")
    script = [_ROWS_ACTOR, address, str(items), "1"] if rows_only else [_ACTOR, address, str(items)]
    procs = [subprocess.Popen([*far, sys.executable, "-c", *script], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) for _ in range(count)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("an actor did not start")
        started, daemon_cpu = time.perf_counter(), time.process_time()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        actor_cpu = 0.0
        for p in procs:
            actor_cpu += json.loads(p.stdout.readline())["cpu"]
        elapsed, daemon_cpu = time.perf_counter() - started, time.process_time() - daemon_cpu
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    total = count * items
    return {"gbps": total * ITEM_BYTES / elapsed / 1e9, "actor_cpu_us": actor_cpu / total * 1e6,
            "daemon_cpu_us": daemon_cpu / total * 1e6}


def measure(link: str, args: argparse.Namespace) -> dict[str, Any]:
    opener = veth_link if link == "veth" else loopback_link
    result: dict[str, Any] = {"ceiling": {}, "learner": {}, "actors": {}}
    with opener() as (host, far):
        for conns in (1, 2, 4):
            result["ceiling"][conns] = tcp_ceiling(host, far, conns, args.seconds)
            print(f"  [{link}] TCP ceiling, {conns} connection(s): {result['ceiling'][conns]:.2f} GB/s", flush=True)
        daemon = start_daemon(host, args.items)
        try:
            address = f"{host}:{daemon.port}"
            for device in [] if args.no_learner else [None] + (["cuda"] if args.device == "cuda" else []):
                for batch in args.batches:
                    for conns in (1, 4):
                        # the ceiling measured again just before: on a shared machine the link's rate drifts
                        r = {"ceiling": tcp_ceiling(host, far, conns, args.seconds)}
                        r.update(learner(address, far, batch, args.seconds, conns, device))
                        key = f"B={batch} conns={conns}" + (" cuda" if device else "")
                        r["ratio"] = r["gbps"] / r["ceiling"]
                        result["learner"][key] = r
                        print(f"  [{link}] learner {key} over {r['kind']}: {r['gbps']:.2f} GB/s "
                              f"({r['ratio']:.2f}x the ceiling of {r['ceiling']:.2f} just before, stale {r['stale']})",
                              flush=True)
            if not args.no_actors:
                for count in (1, 8):
                    for route in ("stream rows", "stream", "grpc"):
                        ceiling = tcp_ceiling(host, far, 1, args.seconds)
                        a = actors(address, far, count, args.actor_items * (4 if route == "stream rows" else 1),
                                   route != "grpc", rows_only=route == "stream rows")
                        a.update(ratio=a["gbps"] / ceiling, ceiling=ceiling)
                        result["actors"][f"{count} {route}"] = a
                        print(f"  [{link}] {count} actor(s) over {route}: {a['gbps']:.2f} GB/s "
                              f"({a['ratio']:.2f}x one connection's ceiling of {ceiling:.2f} just before; CPU per "
                              f"item: actor {a['actor_cpu_us']:.0f} us, daemon {a['daemon_cpu_us']:.0f} us)",
                              flush=True)
        finally:
            daemon.stop()
    return result


def report(results: dict[str, dict[str, Any]]) -> None:
    print("\n== goals ==")
    for link, r in results.items():
        for key, lr in r["learner"].items():
            verdict = "met" if lr["ratio"] >= GOAL_LEARNER else "MISSED"
            print(f"[{link}] learner {key}: {lr['gbps']:.2f} GB/s = {lr['ratio']:.2f}x ceiling {lr['ceiling']:.2f} "
                  f"(goal >= {GOAL_LEARNER}x): {verdict}")
        for key, a in r["actors"].items():
            goal = f"(goal >= {GOAL_ACTOR}x): " + ("met" if a["ratio"] >= GOAL_ACTOR else "MISSED") \
                if key == "1 stream rows" else "(no goal)"
            print(f"[{link}] actors {key}: {a['gbps']:.2f} GB/s = {a['ratio']:.2f}x one connection's ceiling "
                  f"{a['ceiling']:.2f} {goal}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    can_veth = os.geteuid() == 0 and shutil.which("ip") is not None
    parser.add_argument("--links", nargs="+", choices=("veth", "loopback"),
                        default=["veth", "loopback"] if can_veth else ["loopback"])
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 256])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--items", type=int, default=1024, help="items in the table (256.8 KiB each)")
    parser.add_argument("--actor-items", type=int, default=100, help="items each actor writes")
    parser.add_argument("--device", choices=("cuda",), default=None)
    parser.add_argument("--no-actors", action="store_true")
    parser.add_argument("--no-learner", action="store_true", help="only the TCP ceilings and the actors")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"bench_remote: {platform.node()}, {os.cpu_count()} CPUs, {when}"
          f"; items of {ITEM_BYTES} bytes; {args.seconds:g} s per figure", flush=True)
    results = {link: measure(link, args) for link in args.links}
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
