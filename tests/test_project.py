"""Project-frame checks: generated protos match protos/, every package is installable, tests share helpers only
through tests/support."""

from __future__ import annotations

import ast
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


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import in a module, function bodies included; relative ones keep their dots."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}" if node.module else base + alias.name) for alias in node.names]
    return out


def test_tests_share_helpers_only_through_tests_support():
    """No test module imports another test module or a conftest; helpers come from tests.support, fixtures from
    the conftest.py files pytest finds on its own; no relative imports, no _support.py modules."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        where = path.relative_to(ROOT)
        for line, module in _imported_modules(ast.parse(path.read_text(), str(path))):
            last = module.rsplit(".", 1)[-1]
            if module.startswith("."):
                bad.append(f"{where}:{line}: relative import {module}")
            elif last.startswith("test_") or last == "conftest":
                bad.append(f"{where}:{line}: imports {module}")
            elif module.split(".")[0] == "tests" and module != "tests" and not module.startswith("tests.support"):
                bad.append(f"{where}:{line}: imports {module} (helpers belong in tests/support)")
    assert bad == [], "\n".join(bad)
    assert sorted((ROOT / "tests").rglob("_support.py")) == []
    undocumented = [p.name for p in sorted((ROOT / "tests" / "support").glob("*.py"))
                    if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert undocumented == [], f"tests/support modules without a docstring: {undocumented}"
