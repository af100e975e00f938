"""Fixtures of the daemon's tests: a real /dev/shm segment store per test."""

from __future__ import annotations

import os
import uuid

import pytest

from gear_server.storage import SegmentStore
from tests.support.tables import SHM


@pytest.fixture
def store():
    """A SegmentStore under /dev/shm with an instance name unique to this test; checks nothing leaks."""
    if SHM is None:
        pytest.skip("no /dev/shm")
    s = SegmentStore(SHM, f"test{uuid.uuid4().hex[:12]}")
    yield s
    s.close()
    leaked = [n for n in os.listdir(SHM) if n.startswith(f"gear.{s.instance}.")]
    for n in leaked:
        os.unlink(os.path.join(SHM, n))
    assert not leaked, f"segments left behind: {leaked}"
