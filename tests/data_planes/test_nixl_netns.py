"""The nixl plane across hosts for real: learners in another network namespace READ over UCX's TCP transport.

The daemon (this process) binds the host side of a veth pair and its NIXL agent
talks UCX over that interface; learner processes run in the namespace (``ip
netns exec``) with their agent on the other end, so shm is not offered and
every byte crosses the veth link as a NIXL READ. There is no RDMA device here:
UCX_TLS=tcp on both sides.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gear_contract import nixl_agents
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import Churn, fill

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(nixl_agents.unavailable_reason() is not None,
                                 reason=f"{nixl_agents.unavailable_reason()} (make test-nixl)")]

ROOT = Path(__file__).resolve().parents[2]

_LEARNER = """
import json, sys, time
import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from tests.support.trajectories import check_batch
address, seconds = sys.argv[1], float(sys.argv[2])
out = {}
with PlaneSampler(address, "t", planes=["nixl", "inline"]) as s:
    out["kind"] = s.open()
    checked = 0
    deadline = time.monotonic() + seconds
    for batch in s.batches(8):
        checked += check_batch(batch)
        if time.monotonic() > deadline:
            break
    out["pipelined"] = checked
    out["one_by_one"] = sum(check_batch(s.sample(8)) for _ in range(10))
    out["plane"] = s._reader.kind
    out["transfers"] = s._reader.transfers
with reverb.TrajectoryDataset(address, "t", batch_size=4, max_samples=40) as ds:
    out["dataset_items"] = sum(check_batch(b) for b in ds.batches())
    out["dataset_plane"] = ds.plane
print(json.dumps(out))
"""

_LOOPING_LEARNER = """
import logging, sys
from gear_client.data_planes.sampler import PlaneSampler
logging.basicConfig(level=logging.INFO)  # a fallback says why on stderr
s = PlaneSampler(sys.argv[1], "t", planes=["nixl", "inline"])
print(s.open(), flush=True)
for b in s.batches(16):
    pass
"""


@pytest.fixture
def ucx_namespace(module_veth, monkeypatch):
    """The module's veth pair, with this process's UCX on the host side (TCP: no RDMA device)."""
    ns, host_ip, _, host_if, ns_if = module_veth
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", host_if)
    return ns, host_ip, ns_if


def _learner_env(ns_if: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), UCX_TLS="tcp", UCX_NET_DEVICES=ns_if)
    env.pop("GEAR_HOST_ID", None)
    return env


def _in_namespace(ns: str, script: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-c", script, *args]


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_learner_in_another_namespace_reads_checksummed_items_over_nixl_under_churn(ucx_namespace):
    ns, host_ip, ns_if = ucx_namespace
    d = start_daemon(table_config("t", 16), bind=host_ip, nixl=True)
    try:
        fill(d.tables["t"], 16, length=32, dim=2048)  # 256 KiB items
        with Churn(d.tables["t"], length=32, dim=2048) as churn:
            out = subprocess.run(_in_namespace(ns, _LEARNER, f"{host_ip}:{d.port}", "4"), capture_output=True,
                                 text=True, timeout=180, env=_learner_env(ns_if), cwd=ROOT)
        assert out.returncode == 0, out.stderr[-4000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["kind"] == "nixl" and result["plane"] == "nixl" and result["dataset_plane"] == "nixl"
        assert result["pipelined"] >= 40 and result["one_by_one"] == 80 and result["dataset_items"] == 40
        assert result["transfers"] >= 10
        assert churn.inserted >= 20  # the slots were rewritten all along
        assert _wait_for(lambda: d.manager.nixl.segments == ())  # the learners closed: every segment let go
    finally:
        d.stop()


def test_a_learner_killed_mid_read_leaves_the_daemon_healthy_for_the_next(ucx_namespace):
    ns, host_ip, ns_if = ucx_namespace
    d = start_daemon(table_config("t", 32), bind=host_ip, nixl=True, idle_timeout_s=3.0, lease_timeout_s=2.0)
    try:
        fill(d.tables["t"], 32, length=32, dim=2048)
        address = f"{host_ip}:{d.port}"
        proc = subprocess.Popen(_in_namespace(ns, _LOOPING_LEARNER, address), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_learner_env(ns_if), cwd=ROOT)
        try:
            kind = proc.stdout.readline().strip()
            if kind != "nixl":
                proc.kill()
                pytest.fail(f"the learner opened {kind!r} ({d.manager.report.line()}): "
                            f"{proc.communicate(timeout=10)[1][-3000:]}")
            time.sleep(1.0)  # READs of 16 x 256 KiB in flight, one after another
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert _wait_for(lambda: len(d.manager.sessions) == 0) and d.manager.sessions.active_leases() == 0
        assert d.manager.nixl.segments == ()
        out = subprocess.run(_in_namespace(ns, _LEARNER, address, "1"), capture_output=True, text=True, timeout=180,
                             env=_learner_env(ns_if), cwd=ROOT)
        assert out.returncode == 0, out.stderr[-4000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["kind"] == "nixl", out.stderr[-3000:]
    finally:
        d.stop()
