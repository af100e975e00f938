"""A learner on "another host": a network namespace joined to the daemon's by a veth pair.

The learner's host identity differs (its network namespace does), so the daemon
does not offer shm; with no RDMA device on this machine it negotiates inline and
must still get correct batches, both through PlaneSampler / TrajectoryDataset
and through a plain Reverb-style ``client.sample``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import fill

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")

_LEARNER = """
import json, sys
import gear_client as reverb
from gear_contract import rdma_verbs as verbs
from gear_contract.negotiation import local_host_id
from gear_client.data_planes.sampler import PlaneSampler
from tests.support.trajectories import check_batch, item_ok
address = sys.argv[1]
out = {"host_id": local_host_id(), "pyverbs": verbs.unavailable_reason() is None, "probe": verbs.probe() is not None}
with PlaneSampler(address, "t") as s:
    out["sampler_items"] = sum(check_batch(s.sample(8)) for _ in range(3))
    out["sampler_kind"] = s.kind
with reverb.TrajectoryDataset(address, "t", batch_size=4, max_samples=12) as ds:
    out["dataset_items"] = sum(check_batch(b) for b in ds.batches())
    out["dataset_plane"] = ds.plane
client = reverb.Client(address)
good = 0
for sample in client.sample("t", 10, emit_timesteps=False):
    action, obs, reward = sample.data
    good += item_ok(action, obs, reward) and int(action[0]) == sample.info.key
out["client_items"] = good
out["client_plane"] = client._planes.get("t", "unset")
print(json.dumps(out))
"""


def test_a_learner_in_another_namespace_negotiates_inline_and_gets_correct_batches(namespace):
    ns, host_ip = namespace
    d = start_daemon(table_config("t", 32), bind=host_ip)
    try:
        fill(d.tables["t"], 32, length=16, dim=64)
        with tempfile.TemporaryDirectory() as extra:
            path = [str(ROOT)]
            if DEBIAN_PYVERBS.is_dir():  # real pyverbs, as docs/DATA_PLANES.md installs it: it finds no device
                (Path(extra) / "pyverbs").symlink_to(DEBIAN_PYVERBS)
                path.append(extra)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
            env.pop("GEAR_HOST_ID", None)
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _LEARNER, f"{host_ip}:{d.port}"],
                                 capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        d.stop()
    assert result["host_id"] != d.host_id  # another host, as far as memory goes
    assert result["probe"] is False  # no RDMA device: rdma not offered
    if DEBIAN_PYVERBS.is_dir():
        assert result["pyverbs"]  # and that answer came from the real pyverbs
    assert result["sampler_kind"] == "inline" and result["sampler_items"] == 24
    assert result["dataset_plane"] == "inline" and result["dataset_items"] == 12
    assert result["client_plane"] is None and result["client_items"] == 10  # Reverb's client.sample, inline
