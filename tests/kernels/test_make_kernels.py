"""`make kernels-build`: compiles the CUDA sources where nvcc exists, skips with one clear line where not.

Run from a scratch folder (the Makefile by path, gear_kernels linked) so the checkout gains no build files.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import ROOT

MAKE = shutil.which("make")

pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def _make(folder: Path, nvcc: str) -> subprocess.CompletedProcess:
    (folder / "gear_kernels").symlink_to(ROOT / "gear_kernels")
    return subprocess.run([MAKE, "-f", str(ROOT / "Makefile"), "kernels-build", f"NVCC={nvcc}"], cwd=folder,
                          capture_output=True, text=True, timeout=120)


def test_without_nvcc_the_check_is_skipped_and_says_so(tmp_path):
    result = _make(tmp_path, "")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernels-build: skipped: nvcc not found" in result.stdout
    assert "gear_kernels/assemble.cu" in result.stdout
    assert not (tmp_path / ".build").exists()


def test_with_nvcc_every_source_is_compiled_and_a_failure_fails(tmp_path):
    log = tmp_path / "calls"
    fake = tmp_path / "nvcc"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    result = _make(work, str(fake))
    assert result.returncode != 0  # the compile ran and failed: the target fails
    assert "-arch=sm_90 --cubin" in log.read_text()
