"""The `reverb` alias distribution (alias/reverb): built and installed with pip, then Reverb code runs unchanged.

pip builds it from the source tree (no build isolation: nothing is downloaded)
into a target directory; a script written against Reverb (``import reverb``,
``from reverb import structured_writer``) runs on gear from there. Installing
into an environment that holds dm-reverb is refused, and a copy that ended up
over dm-reverb's files refuses to import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIAS = ROOT / "alias" / "reverb"
PIP_TIMEOUT_S = 180

REVERB_SCRIPT = r'''
import numpy as np
import reverb
from reverb import rate_limiters, item_selectors
from reverb import structured_writer as sw
import reverb.errors

import importlib
import gear_client
import gear_client.writers.structured_writer
assert reverb.Client is gear_client.Client and sw is gear_client.writers.structured_writer
for name in gear_client.REVERB_MODULES:
    module = gear_client.reverb_module(name)
    if not module.startswith("gear_client.tf.") or importlib.util.find_spec("tensorflow") is not None:
        assert importlib.import_module("reverb." + name) is importlib.import_module(module), name

server = reverb.Server(tables=[
    reverb.Table(name="replay", sampler=item_selectors.Uniform(), remover=item_selectors.Fifo(), max_size=100,
                 rate_limiter=rate_limiters.MinSize(1)),
    reverb.Table.queue("steps", 10),
])
client = reverb.Client(f"localhost:{server.port}")
with client.trajectory_writer(num_keep_alive_refs=3) as writer:
    for t in range(3):
        writer.append({"obs": np.full(2, t, np.float32), "action": np.int64(t)})
    writer.create_item("replay", 1.0, {"obs": writer.history["obs"][-3:], "action": writer.history["action"][-1]})
config = sw.create_config(sw.pattern_from_transform({"x": None}, lambda ref: {"x": ref["x"][-1]}), "steps")
with client.structured_writer([config]) as writer:
    writer.append({"x": np.float32(7)})
sample = next(client.sample("replay", emit_timesteps=False))
action, obs = sample.data
assert obs.shape == (3, 2) and int(action) == 2, sample
assert float(next(client.sample("steps", emit_timesteps=False)).data[0]) == 7.0
try:
    reverb.Client("localhost")
except ValueError:
    pass
else:
    raise AssertionError("a client without a port was accepted")
server.stop()
print("reverb script ran on", reverb.__file__)
'''


def _alias_source(tmp_path: Path) -> str:
    """A copy of alias/reverb (the tests' pip runs leave the checkout alone)."""
    copy = tmp_path / "alias-src"
    shutil.copytree(ALIAS, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return str(copy)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts)


def _pip(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                           "--no-build-isolation", "--no-input", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


def test_installed_alias_runs_reverb_code_unchanged(tmp_path):
    target = tmp_path / "site"
    source = _alias_source(tmp_path)
    before = _files(Path(source))
    result = _pip("--target", str(target), source)
    assert result.returncode == 0, result.stderr
    assert _files(Path(source)) == before  # no build/ or *.egg-info left in the source folder
    assert (target / "reverb" / "__init__.py").exists()
    assert list(target.glob("gear_reverb_alias-*.dist-info"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", REVERB_SCRIPT], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"reverb script ran on {target}" in run.stdout


def test_install_into_an_environment_with_dm_reverb_is_refused(tmp_path):
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(env_dir)],
                   check=True, timeout=60)
    python = str(env_dir / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    dist_info = Path(purelib) / "dm_reverb-0.14.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: dm-reverb\nVersion: 0.14.0\n")
    result = _pip(_alias_source(tmp_path), python=python)
    assert result.returncode != 0
    assert "refuses to install over dm-reverb" in result.stdout + result.stderr
    assert not (Path(purelib) / "reverb").exists()


def test_a_copy_over_dm_reverb_refuses_to_import(tmp_path):
    site_dir = tmp_path / "site"
    shutil.copytree(ALIAS / "reverb", site_dir / "reverb")
    (site_dir / "dm_reverb-0.14.0.dist-info").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site_dir), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", "import reverb"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert "installed over dm-reverb" in run.stderr
