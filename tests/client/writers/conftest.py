"""The writer tests' recording server on loopback (see _recording.py)."""

from __future__ import annotations

import pytest

from ._recording import LoopbackServer


@pytest.fixture
def server():
    srv = LoopbackServer()
    yield srv
    srv.stop()
