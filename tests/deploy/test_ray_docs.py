"""docs/DEPLOY.md's Ray recipe, run as written (a local one-node Ray) in a child process; ``make test-ray``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytest.importorskip("ray", reason="Ray is not installed (make test-ray)")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

DOC = ROOT / "docs" / "DEPLOY.md"


def _recipe() -> str:
    section = DOC.read_text().split("\n## Ray\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_ray_recipe_runs_as_written(tmp_path):
    code = _recipe().replace("/tmp/gear-ray-demo", str(tmp_path / "ckpt"))
    assert "gear_ray.start(" in code and "replay.stop()" in code
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RAY_ADDRESS": "local"}  # a Ray of its own, never one another test left behind
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "batch shape and plane: ((16, 4, 8), 'shm')" in out.stdout, out.stdout
    # stop() drained: the node's daemon wrote its final checkpoint.
    (node,) = (tmp_path / "ckpt" / "gear").iterdir()
    assert list((node / "checkpoints").iterdir())
