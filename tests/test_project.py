"""Project-frame checks: generated protos match protos/, every package is installable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpcio-tools not installed")
def test_generated_protos_match_sources():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config.get("package-dir", {})
    on_disk = set()
    for top in ("gear_contract", "gear_kernels", "gear_server", "gear_client"):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = list(init.parent.relative_to(ROOT).parts)
            for name, folder in mapping.items():
                if parts[0] == folder:
                    parts[0] = name
            on_disk.add(".".join(parts))
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"


def test_generated_modules_import_on_their_own():
    code = "from gear_contract._proto import replay_pb2, replay_pb2_grpc; print(replay_pb2.Tensor.DESCRIPTOR.full_name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "gear.v1.Tensor"
