"""examples/train_dt_ddp.py end to end on CPU: a daemon, actor processes and two DDP ranks (gloo) reading their rows
of one global selection, then synthetic batches; the run stops by itself and leaves no process behind. The run
needs PyTorch (marker torch: make test-frameworks runs it in .venv-frameworks; skipped where torch is missing)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_dt_ddp.py"
HAS_TORCH = importlib.util.find_spec("torch") is not None
TINY = ["--world-size", "2", "--steps", "4", "--warmup", "1", "--batch", "4", "--context", "8", "--obs-dim", "64",
        "--act-dim", "4", "--d-model", "32", "--layers", "1", "--heads", "2", "--table-size", "256",
        "--actors", "2", "--timeout", "120"]


def run_example(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the example in a session of its own; its output and what is still alive in that session after it exits."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    left = left_behind(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), left


def left_behind(sid: int, grace: float = 10.0) -> list[str]:
    """Processes of session ``sid`` still alive ``grace`` seconds after its leader exited (those exiting on their
    own, as multiprocessing's resource tracker once its parent is gone, get that long); killed before returning."""
    deadline = time.monotonic() + grace
    while (members := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for member in members:  # never leave them running past the test, whatever it asserts
        try:
            os.kill(int(member.split()[0]), 9)
        except ProcessLookupError:
            pass
    return members


def session_members(sid: int) -> list[str]:
    """'pid command' of every live process in session ``sid`` (zombies excluded)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, _ppid, _pgrp, session = text.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            members.append(f"{stat.parent.name} {cmdline}")
    return members


@pytest.mark.torch
@pytest.mark.timeout(400)
@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed here (make test-frameworks runs this test)")
def test_ddp_ranks_train_on_replay_and_on_synthetic_batches_then_everything_stops():
    result, left = run_example(TINY, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert left == [], f"processes left behind: {left}"
    assert "2 ranks on cpu (gloo)" in out
    # Only the model's fields travel (the items also hold rewards), over shared memory: 4 items x 8 steps x
    # (64 + 4 + 1) float32 = 8832 bytes per batch against 8960 for whole items.
    assert "each rank fetched action, observation, return_to_go over shm: 9 KiB per batch of 4 items" in out, out
    replay = re.search(r"replay: +([\d.]+) steps/s, loss ([\d.]+) -> ([\d.]+), waited on replay ([\d.]+)% of step "
                       r"time \(max over ranks; mean ([\d.]+)%\)", out)
    synthetic = re.search(r"synthetic: +([\d.]+) steps/s", out)
    assert replay and synthetic, out
    assert float(replay[1]) > 0 and float(synthetic[1]) > 0
    assert 0 < float(replay[2]) < 10 and 0 < float(replay[3]) < 10  # an MSE of actions in [-1, 1]
    assert 0 <= float(replay[5]) <= float(replay[4]) <= 100
    assert re.search(r"goal: replay wait <= 5% of step time: (met|NOT met)", out)
    assert "parameters identical on all 2 ranks" in out  # DDP kept the ranks in step


@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "--world-size must be >= 1 (got 0)"),
    (["--batch", "64", "--table-size", "100"], "--table-size 100 is below one global batch (128)"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 is not a multiple of --heads 4"),
])
def test_bad_options_are_refused_before_anything_starts(args, message):
    result, left = run_example(args, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "daemon on" not in result.stdout and left == []


@pytest.mark.torch
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_TORCH, reason="PyTorch is not installed here (make test-frameworks runs this test)")
def test_a_daemon_that_dies_during_the_run_ends_it_with_an_error_and_nothing_left_running():
    args = [*TINY[:TINY.index("--steps")], "--steps", "100000", *TINY[TINY.index("--steps") + 2:]]
    # Clients give up on a daemon that is away after GEAR_CONNECT_TIMEOUT seconds (30 unless told).
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", GEAR_CONNECT_TIMEOUT="5")
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("table holds"):
                break
        time.sleep(3)  # the actors are writing, the ranks starting
        daemons = [int(m.split()[0]) for m in session_members(proc.pid) if "gear_server" in m]
        assert len(daemons) == 1, "".join(lines)
        os.kill(daemons[0], 9)
        out = "".join(lines) + proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    left = left_behind(proc.pid)
    assert proc.returncode == 1, out
    assert re.search(r"RuntimeError: learner rank failed: rank \d \(exit code 1\)", out), out
    assert left == [], f"processes left behind: {left}"
