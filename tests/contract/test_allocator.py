"""tune_allocator: opt-in for the client library (the user's process), on by default for the daemon."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

_CHECK = "from gear_contract.allocator import tune_allocator; print(tune_allocator(opt_in={opt_in}))"


def _tuned(opt_in: bool, setting: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "GEAR_MALLOC_TUNING"}
    if setting is not None:
        env["GEAR_MALLOC_TUNING"] = setting
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _CHECK.format(opt_in=opt_in)], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_clients_leave_the_allocator_alone_unless_asked_and_the_daemon_tunes_unless_told_not_to():
    assert not _tuned(opt_in=True, setting=None)  # importing gear_client changes nothing
    assert not _tuned(opt_in=True, setting="0")
    assert _tuned(opt_in=True, setting="1")
    assert _tuned(opt_in=False, setting=None)  # the daemon's own process
    assert not _tuned(opt_in=False, setting="0")
