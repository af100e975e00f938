"""deploy/slurm/gear.sbatch: its syntax, the shard list it builds from SLURM_JOB_NODELIST, and a whole run on this
machine as a one-node allocation (stand-ins for ``scontrol`` and ``srun`` on PATH; the daemon, the learner and the
final checkpoint are real)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gear_server.config import load_config
from tests.support.paths import ROOT
from tests.support.ports import free_port

SCRIPT = ROOT / "deploy" / "slurm" / "gear.sbatch"
CONFIG = ROOT / "deploy" / "slurm" / "gear-shard.toml"
BASH = shutil.which("bash")

# scontrol show hostnames NODELIST: the hosts of a few node lists, and a record of every call.
FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
case "$3" in
    "gpu[01-03]") printf 'gpu01\ngpu02\ngpu03\n' ;;
    "a100-7") printf 'a100-7\n' ;;
    *) printf '%s\n' "$3" ;;
esac
"""
# srun [--options...] COMMAND...: runs COMMAND here (one node), options recorded.
FAKE_SRUN = r"""#!/usr/bin/env bash
options=()
while [[ $# -gt 0 && "$1" == -* ]]; do options+=("$1"); shift; done
echo "srun ${options[*]} :: $*" >> "$FAKE_LOG"
exec "$@"
"""


def _fakes(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls")}


def test_the_script_is_valid_bash():
    assert BASH, "bash is needed"
    subprocess.run([BASH, "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.parametrize(("nodelist", "port", "expected"), [
    ("gpu[01-03]", 8000, "gpu01:8000,gpu02:8000,gpu03:8000"),
    ("a100-7", 9000, "a100-7:9000"),
])
def test_the_shard_list_comes_from_the_job_nodelist(tmp_path, nodelist, port, expected):
    env = _fakes(tmp_path)
    out = subprocess.run([BASH, "-c", f'source "{SCRIPT}" && shard_list "$0" "$1" && first_node "$0"', nodelist,
                          str(port)], env=env, capture_output=True, text=True, timeout=30, check=True)
    shards, first = out.stdout.split()
    assert shards == expected
    assert first == expected.split(",")[0].rsplit(":", 1)[0]
    assert (tmp_path / "calls").read_text().splitlines()[0] == f"show hostnames {nodelist}"


def test_the_script_refuses_to_run_outside_an_allocation(tmp_path):
    env = {k: v for k, v in _fakes(tmp_path).items() if not k.startswith("SLURM_")}
    out = subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "SLURM_JOB_NODELIST" in out.stderr


def test_the_shipped_config_loads():
    settings = load_config(CONFIG)
    assert settings.checkpoint.on_stop and settings.checkpoint.restore
    assert not Path(settings.checkpoint.dir).is_absolute()  # per node: resolved in the node's own folder


def test_a_one_node_job_serves_learns_and_checkpoints(tmp_path):
    """The whole script on a one-node 'allocation' (this host): the daemon starts in <GEAR_STATE>/<host>, the
    learner writes and samples over GEAR_SHARDS, and the daemon's SIGTERM at the end writes its checkpoint."""
    env = _fakes(tmp_path)
    port = free_port()
    config = CONFIG.read_text()
    config = config.replace("port = 9580", f"port = {free_port()}").replace('bind_address = "[::]"',
                                                                         'bind_address = "127.0.0.1"')
    config = config.replace('shm_dir = "/dev/shm"', f'shm_dir = "{tmp_path / "shm"}"')
    config = config.replace('instance_name = "gear"', f'instance_name = "slurm{os.getpid()}"')
    (tmp_path / "shm").mkdir()
    (tmp_path / "gear-shard.toml").write_text(config)
    server = tmp_path / "gear-server"
    server.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m gear_server "$@"\n')
    server.chmod(0o755)
    env.update({
        "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NAME": "gear-test", "GEAR_SERVER": str(server), "GEAR_CONFIG": str(tmp_path / "gear-shard.toml"),
        "GEAR_PORT": str(port), "GEAR_STATE": str(tmp_path / "state"), "PYTHON": sys.executable,
        "LEARNER": f"{sys.executable} {ROOT / 'deploy' / 'gear_learner.py'} --episodes 8 --steps 4 --batches 3 "
                   "--batch-size 4 --timeout-s 30",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    })
    out = subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"shards 127.0.0.1:{port}" in out.stdout
    assert re.search(r"table replay: 8 items over 1 shard", out.stdout), out.stdout
    assert re.search(r"learner: 12 items in .* over shm", out.stdout), out.stdout  # same host: shared memory
    calls = (tmp_path / "calls").read_text()
    assert "srun --overlap --ntasks-per-node=1" in calls and "--nodelist=127.0.0.1" in calls
    node_dir = tmp_path / "state" / socket.gethostname()
    checkpoints = list((node_dir / "checkpoints").iterdir())
    assert checkpoints, f"no final checkpoint in {node_dir}; stderr:\n{out.stderr}"


def test_the_example_learner_writes_what_the_shipped_tables_hold():
    """deploy/gear_learner.py's default items fit the signature of the Slurm and Kubernetes configs."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("gear_learner", ROOT / "deploy" / "gear_learner.py")
    learner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learner)
    args = learner.parse_args(["--shards", "a:1"])
    configmap = (ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text()
    k8s_toml = "\n".join(line[4:] for line in configmap.split("gear-server.toml: |\n", 1)[1].splitlines())
    for document in (tomllib.loads(CONFIG.read_text()), tomllib.loads(k8s_toml)):
        (table,) = document["tables"]
        assert table["name"] == args.table
        assert table["signature"]["observation"] == {"dtype": "float32", "shape": [-1, args.obs_dim]}
        assert set(table["signature"]) == {"observation", "action", "reward"}

