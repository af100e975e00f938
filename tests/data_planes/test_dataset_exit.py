"""A process that used datasets exits, within a bound, whatever its datasets' threads are blocked in.

The learner is a real subprocess that opens datasets and returns from its
script without closing them. It must exit within EXIT_BOUND_S with its dataset
threads blocked in a Select on an empty table (a daemon in its own process);
in the calls that open a plane to a daemon that stopped answering (frozen with
SIGSTOP; GEAR_CONNECT_TIMEOUT=-1, so that nothing but the exit path ends the
wait); or inside the sampler's lock in an OpenDataPlane call that is never
answered (a gRPC server on loopback that answers ServerInfo and holds
OpenDataPlane until it stops): closing at exit must not wait on that lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 30

DAEMON = r"""
import sys, time
import gear_client as reverb
server = reverb.Server([reverb.Table("t", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                                     max_size=10, rate_limiter=reverb.rate_limiters.MinSize(1))])
print(server.port, flush=True)
time.sleep(600)
"""

LEARNER = r"""
import sys, threading, time
from gear_client import datasets
address = sys.argv[1]
opened = [datasets.TrajectoryDataset(address, "t", 2) for _ in range(3)]
for dataset in opened:
    threading.Thread(target=lambda d=dataset: next(iter(d), None), daemon=True).start()
time.sleep(float(sys.argv[2]))
print("exiting", flush=True)
"""


def _start_daemon() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    port = proc.stdout.readline().strip()
    assert port.isdigit(), f"daemon did not start: {port!r}"
    return proc, f"localhost:{port}"


def _run_learner(address: str, settle_s: float, before_exit=None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GEAR_CONNECT_TIMEOUT": "-1"}
    learner = subprocess.Popen([sys.executable, "-c", LEARNER, address, str(settle_s)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    if before_exit is not None:
        before_exit()
    start = time.monotonic()
    try:
        out, err = learner.communicate(timeout=EXIT_BOUND_S + settle_s)
    except subprocess.TimeoutExpired:
        learner.kill()
        out, err = learner.communicate()
        raise AssertionError(f"the learner did not exit within {EXIT_BOUND_S} s of its end: {err[-3000:]}") from None
    return subprocess.CompletedProcess(learner.args, learner.returncode, out, err), time.monotonic() - start


def test_exit_with_datasets_waiting_on_an_empty_table():
    daemon, address = _start_daemon()
    try:
        done, _ = _run_learner(address, settle_s=3)
        assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-3000:]
    finally:
        daemon.kill()
        daemon.wait()


def test_exit_with_datasets_blocked_on_a_frozen_daemon():
    daemon, address = _start_daemon()
    try:
        os.kill(daemon.pid, signal.SIGSTOP)  # every call to it now waits: only the exit path can end them
        done, _ = _run_learner(address, settle_s=4)
        assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-3000:]
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        daemon.kill()
        daemon.wait()


class _NeverOpens(pb_grpc.ReplayServiceServicer):
    """Answers ServerInfo (one table, read ahead allowed); holds every OpenDataPlane until released."""

    def __init__(self):
        self.release = threading.Event()
        self.opening = threading.Event()

    def ServerInfo(self, request, context):  # noqa: N802 - the gRPC method's name
        return pb.ServerInfoResponse(table_info=[pb.TableInfo(name="t", max_size=10)], host_id="elsewhere")

    def OpenDataPlane(self, request, context):  # noqa: N802 - the gRPC method's name
        self.opening.set()
        self.release.wait(EXIT_BOUND_S * 3)
        context.abort(grpc.StatusCode.UNAVAILABLE, "stopping")


def test_exit_with_a_dataset_thread_holding_the_sampler_lock_in_an_unanswered_call():
    servicer = _NeverOpens()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ReplayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done, _ = _run_learner(f"127.0.0.1:{port}", settle_s=3)
        assert servicer.opening.is_set(), "the learner never opened a plane"
        assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-3000:]
    finally:
        servicer.release.set()
        server.stop(grace=None)
