"""A daemon other hosts can reach serves without a token or TLS only when told so, and says so.

Real daemon processes on every interface (``0.0.0.0``) and on loopback.
"""

from __future__ import annotations

import uuid

import pytest

import gear_client
from gear_server.ops.auth import is_loopback
from tests.support.daemon_process import DaemonProcess, run_daemon
from tests.support.tables_toml import tables_toml


def _config(bind: str, auth: str = "") -> str:
    text = tables_toml(f"exp{uuid.uuid4().hex[:8]}").replace('bind_address = "127.0.0.1"', f'bind_address = "{bind}"')
    return text + (f"\n[auth]\n{auth}\n" if auth else "")


def test_every_interface_without_token_or_tls_is_refused_naming_the_ways_out(tmp_path):
    path = tmp_path / "open.toml"
    path.write_text(_config("0.0.0.0"))
    result = run_daemon(path)
    assert result.returncode == 2, result.stderr  # a configuration error: the unit does not restart it
    text = result.stderr
    assert "refusing to serve 0.0.0.0 with neither a token nor TLS" in text, text
    for way_out in ("token_file in [auth]", "--generate-token", "TLS", 'bind_address = "127.0.0.1"',
                    "allow_insecure = true in [auth]", "--allow-insecure"):
        assert way_out in text, (way_out, text)
    assert "serving" not in text


@pytest.mark.parametrize("how", ["config", "flag"])
def test_the_opt_out_serves_every_interface_and_says_so(tmp_path, how):
    config = _config("0.0.0.0", "allow_insecure = true" if how == "config" else "")
    args = ("--allow-insecure",) if how == "flag" else ()
    daemon = DaemonProcess(tmp_path, config, args=args)
    try:
        daemon.wait_ready()
        assert gear_client.Client(daemon.address).server_info(timeout=30)["queue"].max_size == 100
    finally:
        assert daemon.stop() == 0
    assert "serving 0.0.0.0 with neither a token nor TLS (allow_insecure)" in daemon.log, daemon.log
    assert "security: no token, plaintext, open to every host that reaches it (allow_insecure)" in daemon.log


def test_a_token_or_loopback_needs_no_opt_out(tmp_path):
    token = tmp_path / "token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    for name, config in (("token", _config("0.0.0.0", f'token_file = "{token}"')),
                         ("loopback", _config("127.0.0.1"))):
        daemon = DaemonProcess(tmp_path, config, name)
        try:
            daemon.wait_ready()
        finally:
            assert daemon.stop() == 0
        assert "allow_insecure" not in daemon.log, daemon.log


def test_loopback_addresses():
    for address in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost", "unix:/tmp/x.sock"):
        assert is_loopback(address), address
    for address in ("0.0.0.0", "[::]", "::", "10.1.2.3", "no-such-host.invalid"):
        assert not is_loopback(address), address
