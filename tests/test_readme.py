"""Every python block of README.md runs, in order, in one namespace (as a reader would paste them).

A block that needs something the machine may lack says so on the line before it:
``<!-- readme-test: needs tensorflow -->`` (or ``gpu``); such blocks are skipped
explicitly, by name, where it is missing, never edited. The ``reverb`` alias
(alias/reverb) is put on the path, as its README section says to install it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ALIAS_SOURCE = ROOT / "alias" / "reverb"
_BLOCK = re.compile(r"(?:<!-- readme-test: needs (?P<needs>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```",
                    re.S | re.M)
RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    line: int
    needs: str | None
    code: str


def python_blocks(text: str) -> list[Block]:
    blocks = []
    for match in _BLOCK.finditer(text):
        if match.group("lang") == "python":
            line = text.count("\n", 0, match.start("code")) + 1
            blocks.append(Block(line, match.group("needs"), match.group("code")))
    return blocks


def _available(need: str) -> bool:
    if need == "tensorflow":
        return importlib.util.find_spec("tensorflow") is not None
    if need == "gpu":
        try:
            import cupy

            return cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:  # noqa: BLE001 - no cupy, no driver, no device
            return False
    raise AssertionError(f"README.md names an unknown need {need!r}")


_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for line, code in json.loads(sys.argv[1]):
    exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
    print(f"README.md block at line {line}: ok", flush=True)
"""


def test_the_readme_has_python_blocks():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3
    assert any("import reverb" in b.code for b in blocks)


def _run(blocks: list[Block], folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ALIAS_SOURCE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps([(b.line, b.code) for b in blocks])],
                            cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}"
    assert result.stdout.count(": ok") == len(blocks)


def test_every_python_block_that_needs_nothing_runs(tmp_path):
    _run([b for b in python_blocks(README.read_text()) if b.needs is None], tmp_path)


@pytest.mark.parametrize("need", sorted({b.needs for b in python_blocks(README.read_text()) if b.needs}))
def test_the_blocks_that_need(need, tmp_path):
    """The blocks marked with this need, after the blocks before them that need nothing (they build on them)."""
    if not _available(need):
        pytest.skip(f"README blocks that need {need}: {need} is missing here")
    blocks = python_blocks(README.read_text())
    last = max(b.line for b in blocks if b.needs == need)
    _run([b for b in blocks if b.line <= last and b.needs in (None, need)], tmp_path)
