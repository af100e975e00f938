"""Fixtures of the compatibility suite: one server per test module, a client per test."""

from __future__ import annotations

import pytest

from tests.support.compat import reverb, standard_tables


@pytest.fixture(scope="module")
def tables() -> list:
    """The shared server's Table objects (live views of the served tables)."""
    return standard_tables()


@pytest.fixture(scope="module")
def server(tables):
    srv = reverb.Server(tables=tables, port=None)
    yield srv
    srv.stop()


@pytest.fixture
def client(server, tables):
    """A client of the shared server; every table starts empty with zeroed counters."""
    c = reverb.Client(f"localhost:{server.port}")
    for table in tables:
        c.reset(table.name)
    return c


@pytest.fixture
def table_by_name(tables) -> dict:
    return {t.name: t for t in tables}
