"""Control-plane benchmark: many open writer streams on one daemon, and per-call latency.

Prints, against the control plane's goals (docs/BENCHMARKS.md):

* 1,000 actors (threads in ``--procs`` client processes, each actor its own
  ``Client`` and open ``trajectory_writer``) on one daemon (a child process):
  all first items acknowledged with every stream open at once, then 4 more items
  each; the time, the items in the table, and the daemon's RSS per open stream
  (RSS with all streams open minus RSS before, divided by the streams);
* ``mutate_priorities`` of 32 and 256 keys (median over ``--rounds`` calls, through
  the Reverb API on a Prioritized(0.8) table of 2,048 items);
* the Select round trip of a learner's data-plane session (32 and 256 items,
  each Select ending the previous lease, as a pipelining learner does), and the
  cost per batch when one Select asks 4 batches (``num_batches``);
* 10,000 calls without the token (health ``Watch`` streams and InsertStreams)
  opened at once: how they end, and the latency of authenticated calls meanwhile;
* with ``--reverb-python`` (default ``.venv-reverb/bin/python`` when it exists),
  DeepMind Reverb's ``mutate_priorities`` latency on the same table, side by
  side: the goal is gear's mutate and Select round trip <= Reverb's mutate.

Usage: ``python bench/bench_streams.py [--actors 1000] [--procs 2] [--rounds 300]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gear_client as reverb
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.lane_frames import SELECT
from gear_contract.negotiation import local_host_id

ITEMS_PER_ACTOR = 5
TABLE_ITEMS = 2048
TOKEN = "bench-streams-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """``python -m gear_server --config`` as a child process (its pid gives its RSS)."""

    def __init__(self, actors: int):
        self.port = free_port()
        self.folder = tempfile.TemporaryDirectory(prefix="gear-bench-streams-")
        config = Path(self.folder.name) / "gear.toml"
        config.write_text(f'''
bind_address = "127.0.0.1"
port = {self.port}
instance_name = "benchstreams{os.getpid()}"

[limits]
max_streams = {max(4096, 2 * actors)}

[auth]
token = "{TOKEN}"

[[tables]]
name = "writes"
sampler = "fifo"
remover = "fifo"
max_size = {actors * ITEMS_PER_ACTOR}
rate_limiter = {{ min_size = 1 }}

[[tables]]
name = "prio"
sampler = {{ prioritized = {{ priority_exponent = 0.8 }} }}
remover = "fifo"
max_size = {TABLE_ITEMS}
rate_limiter = {{ min_size = 1 }}
''')
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("NOTIFY_SOCKET", None)
        self.process = subprocess.Popen([sys.executable, "-m", "gear_server", "--config", str(config),
                                         "--log-level", "WARNING"], env=env, stdin=subprocess.DEVNULL)
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        channel = grpc.insecure_channel(self.address)
        while True:
            try:
                pb_grpc.ReplayServiceStub(channel).ServerInfo(pb.ServerInfoRequest(), timeout=2, metadata=AUTH)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise SystemExit("the daemon did not start") from None
                time.sleep(0.2)
        channel.close()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon used so far."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.folder.cleanup()


# ------------------------------------------------------------------ many writers

def _actors(address: str, first: int, count: int, opened, proceed, done) -> None:
    """``count`` actor threads (one client process): first item, wait for all, then the rest."""
    failures = []

    def actor(i: int) -> None:
        try:
            client = reverb.Client(address, token=TOKEN)
            with client.trajectory_writer(num_keep_alive_refs=1) as writer:
                for k in range(ITEMS_PER_ACTOR):
                    writer.append({"x": np.full(16, i * ITEMS_PER_ACTOR + k, np.float32)})
                    writer.create_item("writes", 1.0, {"x": writer.history["x"][-1]})
                    if k == 0:
                        writer.flush()  # acknowledged: this actor's stream is open and served
                        opened.release()
                        proceed.wait()
                writer.flush()
        except BaseException as e:  # noqa: BLE001 - reported as the actor's failure
            failures.append(repr(e))

    threads = [threading.Thread(target=actor, args=(first + i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.put(failures + ["actor thread still running"] * sum(t.is_alive() for t in threads))


def many_writers(daemon: DaemonProcess, actors: int, procs: int) -> dict:
    ctx = mp.get_context("spawn")
    opened, proceed, done = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    rss_before = daemon.rss_bytes()
    cpu_before = daemon.cpu_seconds()
    share = [actors // procs + (1 if p < actors % procs else 0) for p in range(procs)]
    children = []
    first = 0
    started = time.perf_counter()
    for count in share:
        children.append(ctx.Process(target=_actors, args=(daemon.address, first, count, opened, proceed, done)))
        first += count
        children[-1].start()
    for _ in range(actors):
        if not opened.acquire(timeout=300):
            raise SystemExit("not every actor got its first item acknowledged within 300 s")
    all_open = time.perf_counter()
    rss_open = daemon.rss_bytes()
    proceed.set()
    failures = [f for _ in children for f in done.get(timeout=300)]
    finished = time.perf_counter()
    cpu = daemon.cpu_seconds() - cpu_before
    for c in children:
        c.join(60)
    client = reverb.Client(daemon.address, token=TOKEN)
    stored = client.server_info(timeout=30)["writes"].current_size
    return {"actors": actors, "procs": procs, "failures": failures, "open_s": all_open - started,
            "total_s": finished - started, "items": stored, "rss_before": rss_before, "rss_open": rss_open,
            "rss_per_stream": (rss_open - rss_before) / actors, "daemon_cpu_s": cpu}


# ------------------------------------------------------------------ latency

def _median_ms(fn, rounds: int) -> float:
    for _ in range(min(30, rounds)):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def latencies(daemon: DaemonProcess, rounds: int) -> dict:
    client = reverb.Client(daemon.address, token=TOKEN)
    for _ in range(TABLE_ITEMS):
        client.insert({"x": np.zeros(16, np.float32)}, {"prio": 1.0})
    keys = [s.info.key for s in client.sample("prio", 256, emit_timesteps=False)]
    out = {}
    for batch in (32, 256):
        updates = {k: 2.0 for k in keys[:batch]}
        out[f"mutate_b{batch}_ms"] = _median_ms(lambda u=updates: client.mutate_priorities("prio", updates=u), rounds)
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(daemon.address))
    session = stub.OpenDataPlane(pb.OpenDataPlaneRequest(
        table="prio", offer=pb.DataPlaneOffer(shm=True, host_id=local_host_id())), timeout=10,
        metadata=AUTH).session_id
    held: list[int] = []

    def select(n: int, batches: int = 1) -> None:
        response = stub.Select(pb.SelectRequest(session_id=session, num_samples=n, num_batches=batches, packed=True,
                                                release_lease_ids=held), timeout=10, metadata=AUTH)
        held[:] = list(response.batch_lease_ids) or [response.lease_id]

    for n in (32, 256):
        out[f"select_b{n}_ms"] = _median_ms(lambda n=n: select(n), rounds)
    out["select_4x32_ms_per_batch"] = _median_ms(lambda: select(32, 4), rounds) / 4
    lane = client._daemon_channel().local_lane()  # what a learner on the daemon's host uses
    if lane is not None:
        def select_on_lane(n: int) -> None:
            request = pb.SelectRequest(session_id=session, num_samples=n, packed=True, release_lease_ids=held)
            held[:] = [pb.SelectResponse.FromString(lane.call(SELECT, request.SerializeToString())).lease_id]

        for n in (32, 256):
            out[f"select_lane_b{n}_ms"] = _median_ms(lambda n=n: select_on_lane(n), rounds)
    return out


def unauthenticated_flood(daemon: DaemonProcess, calls: int) -> dict:
    """``calls`` health Watch streams and ``calls`` InsertStreams without the token, all opened at once,
    then authenticated ServerInfo calls: how the refused calls ended and what the others waited."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.insecure_channel(daemon.address) for _ in range(8)]
    rss_before = daemon.rss_bytes()
    started = time.perf_counter()
    watches, inserts = [], []
    for n in range(calls):
        channel = channels[n % len(channels)]
        watches.append(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120))
        inserts.append(pb_grpc.ReplayServiceStub(channel).InsertStream(iter(()), timeout=120))
    opened = time.perf_counter() - started
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(daemon.address))
    authenticated_ms = _median_ms(lambda: stub.ServerInfo(pb.ServerInfoRequest(), timeout=30, metadata=AUTH), 50)
    codes: dict[str, int] = {}
    for call in inserts:
        try:
            for _ in call:
                pass
            name = "OK"
        except grpc.RpcError as e:
            name = e.code().name
        codes[f"InsertStream {name}"] = codes.get(f"InsertStream {name}", 0) + 1
    rss_open = daemon.rss_bytes()
    for call in watches:
        name = call.code().name if call.done() else "open"
        codes[f"Watch {name}"] = codes.get(f"Watch {name}", 0) + 1
        call.cancel()
    for channel in channels:
        channel.close()
    return {"calls": calls, "opened_s": opened, "authenticated_ms": authenticated_ms, "codes": codes,
            "rss_growth": rss_open - rss_before}


REVERB_SCRIPT = r'''
import json, statistics, sys, time
import numpy as np
import reverb
rounds = int(sys.argv[1])
server = reverb.Server(tables=[reverb.Table("prio", sampler=reverb.selectors.Prioritized(0.8),
                       remover=reverb.selectors.Fifo(), max_size=2048, rate_limiter=reverb.rate_limiters.MinSize(1))])
client = reverb.Client(f"localhost:{server.port}")
for _ in range(2048):
    client.insert({"x": np.zeros(16, np.float32)}, {"prio": 1.0})
keys = [s[0].info.key for s in client.sample("prio", 256)]
out = {}
for batch in (32, 256):
    updates = {k: 2.0 for k in keys[:batch]}
    for _ in range(30):
        client.mutate_priorities("prio", updates=updates)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        client.mutate_priorities("prio", updates=updates)
        times.append(time.perf_counter() - t)
    out[f"mutate_b{batch}_ms"] = statistics.median(times) * 1e3
print("RESULT " + json.dumps(out))
'''


def reverb_latencies(python: str, rounds: int) -> dict | None:
    proc = subprocess.run([python, "-c", REVERB_SCRIPT, str(rounds)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(proc.stdout[-2000:], file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2, help="client processes the actors are spread over")
    parser.add_argument("--rounds", type=int, default=300, help="calls per latency figure")
    parser.add_argument("--flood", type=int, default=10_000, help="calls without the token opened at once")
    default_reverb = ROOT / ".venv-reverb" / "bin" / "python"
    parser.add_argument("--reverb-python", default=str(default_reverb) if default_reverb.exists() else None)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    print(f"control-plane benchmark ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()})")
    daemon = DaemonProcess(args.actors)
    try:
        writers = many_writers(daemon, args.actors, args.procs)
        lat = latencies(daemon, args.rounds)
        flood = unauthenticated_flood(daemon, args.flood) if args.flood else None
    finally:
        daemon.stop()
    ok = not writers["failures"] and writers["items"] == args.actors * ITEMS_PER_ACTOR
    print(f"  {args.actors} actors with open writer streams ({args.procs} client processes): "
          f"{'all complete' if ok else 'NOT all complete'} - {writers['items']} items in "
          f"{writers['total_s']:.2f} s (all {args.actors} streams open and served after {writers['open_s']:.2f} s)"
          f"  (goal: all complete: {'met' if ok else 'MISSED'})")
    print(f"    the daemon used {writers['daemon_cpu_s']:.2f} s of CPU for it (the rest is the clients' time)")
    if writers["failures"]:
        print(f"    failures: {writers['failures'][:3]}")
    print(f"  daemon RSS: {writers['rss_before'] / 2**20:.1f} MiB before, {writers['rss_open'] / 2**20:.1f} MiB with "
          f"every stream open: {writers['rss_per_stream'] / 1024:.1f} KiB per open stream")
    if flood:
        print(f"  {flood['calls']} health Watch streams + {flood['calls']} InsertStreams without the token, opened in "
              f"{flood['opened_s']:.2f} s: {dict(sorted(flood['codes'].items()))}; authenticated ServerInfo "
              f"meanwhile: median {flood['authenticated_ms']:.3f} ms; "
              f"daemon RSS +{flood['rss_growth'] / 2**20:.1f} MiB")
    reverb_lat = reverb_latencies(args.reverb_python, args.rounds) if args.reverb_python else None
    goal = {32: None, 256: None}
    if reverb_lat:
        goal = {32: reverb_lat["mutate_b32_ms"], 256: reverb_lat["mutate_b256_ms"]}

    def against(value: float, batch: int) -> str:
        if goal[batch] is None:
            return "(goal: <= Reverb's mutate_priorities latency; run with --reverb-python)"
        mark = "met" if value <= goal[batch] else "MISSED"
        return f"(Reverb mutate {goal[batch]:.3f} ms: {value / goal[batch]:.2f}x, goal <= 1x {mark})"

    for batch in (32, 256):
        print(f"  mutate_priorities of {batch:>3} keys: median {lat[f'mutate_b{batch}_ms']:.3f} ms  "
              f"{against(lat[f'mutate_b{batch}_ms'], batch)}")
    for batch in (32, 256):
        print(f"  Select round trip over gRPC, {batch:>3} items: median {lat[f'select_b{batch}_ms']:.3f} ms  "
              f"{against(lat[f'select_b{batch}_ms'], batch)}")
    for batch in (32, 256):
        if f"select_lane_b{batch}_ms" in lat:
            print(f"  Select round trip over the local lane (a learner on the daemon's host), {batch:>3} items: "
                  f"median {lat[f'select_lane_b{batch}_ms']:.3f} ms  {against(lat[f'select_lane_b{batch}_ms'], batch)}")
    print(f"  Select of 4 batches of 32 (num_batches=4): {lat['select_4x32_ms_per_batch']:.3f} ms per batch  "
          f"{against(lat['select_4x32_ms_per_batch'], 32)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"writers": writers, "latency": lat, "flood": flood,
                                               "reverb": reverb_lat}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
