"""Fixtures of several test folders: a throw-away PKI (server/ops and client tests use it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pki import OPENSSL, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Path:
    """ca.crt; server.{crt,key} for localhost/127.0.0.1; client.{crt,key} from ca; rogue.{crt,key} from another CA."""
    if OPENSSL is None:
        pytest.skip("the openssl CLI is not installed: cannot make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))
