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


# ---------------------------------------------------------------- import rules between packages

PACKAGES = ("gear_contract", "gear_kernels", "gear_server", "gear_client")
# Which top-level packages each may import. The contract is below everything; kernels build on the contract;
# the daemon and the client build on both and never import each other, except that gear_client/server.py
# (``reverb.Server``) starts the daemon as a child process.
MAY_IMPORT = {
    "gear_contract": {"gear_contract"},
    "gear_kernels": {"gear_contract", "gear_kernels"},
    "gear_server": {"gear_contract", "gear_kernels", "gear_server"},
    "gear_client": {"gear_contract", "gear_kernels", "gear_client"},
}
IMPORT_EXCEPTIONS = {("gear_client/server.py", "gear_server")}
# The generated protos (tools/gen_protos.py writes them) are where every package takes its message classes from
# (docs/DESIGN.md): the one underscored module other packages may import.
PUBLIC_PRIVATE_MODULES = {"gear_contract._proto"}


def _package_of(path: Path) -> str:
    """The package a source file belongs to (its own name for an ``__init__.py``)."""
    return ".".join(path.parent.relative_to(ROOT).parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    base = _package_of(path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(name: str) -> bool:
    rel = ROOT.joinpath(*name.split("."))
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def _owner(module: str) -> str:
    """The package whose private names ``module`` (a module or package) holds: the package itself, or the
    package a plain module sits in."""
    return module if (ROOT.joinpath(*module.split(".")) / "__init__.py").is_file() else module.rpartition(".")[0]


def _private_part(module: str) -> str | None:
    """The first underscored component of a dotted module name, as the dotted prefix ending there."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[: i + 1])
    return None


def _crosses(importer_package: str, owner: str) -> bool:
    """Whether ``owner``'s private names are foreign to ``importer_package`` (not the same package or one
    inside it)."""
    return not (importer_package == owner or importer_package.startswith(owner + "."))


def import_problems(path: Path) -> list[str]:
    """Imports of ``path`` that break the layering or reach into another package's private names."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), rel)
    package = _package_of(path)
    top = package.split(".")[0]
    problems = []
    module_aliases: dict[str, str] = {}  # local name -> the module it is bound to (for ``alias._name`` uses)
    imported: list[tuple[ast.AST, str, str | None]] = []  # (node, module, name imported from it)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported.append((node, alias.name, None))
                if alias.asname:
                    module_aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(path, node)
            for alias in node.names:
                imported.append((node, module, alias.name))
                if _is_module(f"{module}.{alias.name}"):
                    module_aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node, module, name in imported:
        target_top = module.split(".")[0]
        if target_top not in PACKAGES:
            continue
        where = f"{rel}:{node.lineno}"
        if target_top not in MAY_IMPORT[top] and (rel, target_top) not in IMPORT_EXCEPTIONS:
            problems.append(f"{where}: {top} imports {module} (a package above it)")
        full = f"{module}.{name}" if name is not None and _is_module(f"{module}.{name}") else module
        private = _private_part(full)
        if private is not None and private not in PUBLIC_PRIVATE_MODULES and \
                _crosses(package, private.rpartition(".")[0]):
            problems.append(f"{where}: imports the private module {private}")
        if name is not None and name.startswith("_") and not name.startswith("__") and full == module and \
                _crosses(package, _owner(module)):
            problems.append(f"{where}: imports the private name {name} from {module}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and node.value.id in module_aliases:
            module = module_aliases[node.value.id]
            if module.split(".")[0] in PACKAGES and _crosses(package, _owner(module)):
                problems.append(f"{rel}:{node.lineno}: uses the private name {node.attr} of {module}")
    return problems


def test_no_import_reaches_up_a_layer_or_into_another_package_s_private_names():
    problems = [p for top in PACKAGES for path in sorted((ROOT / top).rglob("*.py"))
                if "_proto" not in path.parts for p in import_problems(path)]
    assert problems == [], "\n".join(problems)


def test_the_import_check_sees_what_it_should(tmp_path, monkeypatch):
    """The checker itself: each rule flags a planted offence and lets the allowed forms through."""
    root = tmp_path
    files = {
        "gear_contract/__init__.py": "",
        "gear_contract/bad.py": "from gear_server.table import Table\n",
        "gear_server/__init__.py": "",
        "gear_server/table/__init__.py": "",
        "gear_server/table/_hidden.py": "X = 1\n",
        "gear_server/table/core.py": "_SECRET = 1\nfrom gear_server.table._hidden import X\n",
        "gear_server/table/selectors/__init__.py": "from gear_server.table.core import _SECRET\n",
        "gear_server/rpc/__init__.py": "",
        "gear_server/rpc/a.py": "from gear_server.table.core import _SECRET\n",
        "gear_server/rpc/b.py": "from gear_server.table import _hidden\n",
        "gear_server/rpc/c.py": "from gear_server.table import core\nY = core._SECRET\n",
        "gear_server/rpc/d.py": "from gear_contract._proto import replay_pb2\n",
        "gear_kernels/__init__.py": "",
        "gear_kernels/e.py": "from ._x import y\n",
        "gear_client/__init__.py": "",
        "gear_client/server.py": "from gear_server.table import core\n",
        "gear_client/f.py": "import gear_server.table.core\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", root)
    found = {name: import_problems(root / name) for name in files}
    assert found["gear_contract/bad.py"] == ["gear_contract/bad.py:1: gear_contract imports gear_server.table "
                                             "(a package above it)"]
    assert found["gear_server/table/core.py"] == []  # its own package's private module
    assert found["gear_server/table/selectors/__init__.py"] == []  # a sub-package of the owner
    assert found["gear_server/rpc/a.py"] == ["gear_server/rpc/a.py:1: imports the private name _SECRET from "
                                             "gear_server.table.core"]
    assert found["gear_server/rpc/b.py"] == ["gear_server/rpc/b.py:1: imports the private module "
                                             "gear_server.table._hidden"]
    assert found["gear_server/rpc/c.py"] == ["gear_server/rpc/c.py:2: uses the private name _SECRET of "
                                             "gear_server.table.core"]
    assert found["gear_server/rpc/d.py"] == []
    assert found["gear_kernels/e.py"] == []  # relative, inside its own package
    assert found["gear_client/server.py"] == []  # the documented exception
    assert found["gear_client/f.py"] == ["gear_client/f.py:1: gear_client imports gear_server.table.core "
                                         "(a package above it)"]
