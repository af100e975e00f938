"""Every python block of README.md runs on its own, as written, in a fresh interpreter (as a reader pastes one).

A block that needs something the machine may lack says so on the line before it:
``<!-- readme-test: needs tensorflow -->`` (or ``gpu``); such blocks are skipped
explicitly, by name, where it is missing, never edited. The ``reverb`` alias
(alias/reverb) is put on the path, as its README section says to install it.
"""

from __future__ import annotations

import importlib.util
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
    """The python blocks of a Markdown text, with the line their code starts on and what they need."""
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


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3
    assert any("import reverb" in b.code for b in BLOCKS)


def test_python_blocks_parses_needs_and_lines():
    text = "intro\n```python\na = 1\n```\n<!-- readme-test: needs gpu -->\n```python\nb = 2\n```\n```sh\nls\n```\n"
    assert python_blocks(text) == [Block(3, None, "a = 1\n"), Block(7, "gpu", "b = 2\n")]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_each_python_block_runs_alone(block: Block, tmp_path: Path):
    """One block, in a new interpreter: the names it uses must come from its own imports and setup."""
    if block.needs and not _available(block.needs):
        pytest.skip(f"README block at line {block.line} needs {block.needs}: {block.needs} is missing here")
    script = tmp_path / "block.py"
    # Blank lines first, so a traceback's line numbers are README.md's.
    script.write_text("\n" * (block.line - 1) + block.code)
    path = os.pathsep.join(p for p in (str(ALIAS_SOURCE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, (f"README.md block at line {block.line} failed on its own\n"
                                    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-6000:]}")
