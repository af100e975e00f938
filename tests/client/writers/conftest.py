"""The writer tests' recording server on loopback (tests/support/recording.py)."""

from __future__ import annotations

import pytest

from tests.support.recording import LoopbackServer


@pytest.fixture
def server():
    srv = LoopbackServer()
    yield srv
    srv.stop()
