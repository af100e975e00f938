"""The systemd unit, the install script and the example config (deploy/)."""

from __future__ import annotations

import configparser
import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gear_server.checkpoint.checkpointer import CheckpointSettings
from gear_server.config import load_config
from gear_server.data_planes.settings import DataPlaneSettings
from gear_server.ops.auth import AuthSettings
from gear_server.ops.logs import LoggingSettings
from gear_server.ops.metrics import MetricsSettings
from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "gear-server.service"
EXAMPLE = DEPLOY / "gear-server.example.toml"
GEAR_SERVER = Path(sys.executable).with_name("gear-server")


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(path)
    return parser


def _seconds(value: str) -> float:
    units = {"min": 60, "s": 1, "h": 3600}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def test_the_unit_says_what_the_service_needs():
    service = _unit(UNIT)["Service"]
    assert service["Type"] == "notify"
    assert service["Restart"] == "on-failure"
    assert service["User"] == "gear" and service["Group"] == "gear"
    assert service["LimitMEMLOCK"] == "infinity"  # pinned and RDMA-registered table memory
    assert service["ExecStart"].endswith("gear-server --config /etc/gear/gear-server.toml")
    assert _seconds(service["TimeoutStopSec"]) >= 600  # the final checkpoint of large tables
    assert service["KillSignal"] == "SIGTERM"
    assert "PrivateDevices" not in service  # GPUs, RDMA devices and /dev/shm stay reachable
    assert _unit(UNIT)["Install"]["WantedBy"] == "multi-user.target"


def _stage(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    if not GEAR_SERVER.exists():
        pytest.skip(f"{GEAR_SERVER} is not installed (make install)")
    return subprocess.run(["bash", str(DEPLOY / "install-service.sh"), "--root", str(tmp_path / "root"),
                           "--gear-server", str(GEAR_SERVER), *extra],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": os.environ["PATH"]})


def test_install_script_stages_config_token_docs_and_a_rendered_unit(tmp_path):
    result = _stage(tmp_path, "--generate-token")
    assert result.returncode == 0, result.stdout + result.stderr
    root = tmp_path / "root"
    config = root / "etc/gear/gear-server.toml"
    token = root / "etc/gear/token"
    unit = root / "etc/systemd/system/gear-server.service"
    # The token is in force: the example's commented token_file line now names it, nothing else changed.
    installed, example = config.read_text().splitlines(), EXAMPLE.read_text().splitlines()
    changed = [(a, b) for a, b in zip(installed, example, strict=True) if a != b]
    assert changed == [('token_file = "/etc/gear/token"', next(line for line in example
                                                               if line.startswith("# token_file =")))]
    assert load_config(config).auth.token_file == "/etc/gear/token"
    assert 'token in force: token_file = "/etc/gear/token"' in result.stdout
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    assert stat.S_IMODE(token.stat().st_mode) == 0o640 and len(token.read_text().strip()) == 64
    assert (root / "opt/gear/doc/OPERATIONS.md").exists()
    service = _unit(unit)["Service"]
    assert service["ExecStart"] == f"{GEAR_SERVER} --config /etc/gear/gear-server.toml"

    # Running it again keeps the operator's config and token.
    config.write_text(config.read_text() + "\n# edited\n")
    secret = token.read_text()
    again = _stage(tmp_path, "--generate-token")
    assert again.returncode == 0, again.stderr
    assert config.read_text().endswith("# edited\n") and token.read_text() == secret
    assert "keeping the existing /etc/gear/gear-server.toml" in again.stdout


def test_install_script_refuses_what_it_cannot_do(tmp_path):
    script = str(DEPLOY / "install-service.sh")
    no_server = subprocess.run(["bash", script, "--root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert no_server.returncode != 0 and "--gear-server" in no_server.stderr
    relative = subprocess.run(["bash", script, "--root", str(tmp_path), "--gear-server", "/bin/true",
                               "--prefix", "opt"], capture_output=True, text=True, timeout=60)
    assert relative.returncode != 0 and "absolute" in relative.stderr
    unknown = subprocess.run(["bash", script, "--frobnicate"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode != 0 and "unknown option" in unknown.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: the systemd package)")
def test_systemd_analyze_verify_accepts_the_rendered_unit(tmp_path):
    result = _stage(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    unit = tmp_path / "root/etc/systemd/system/gear-server.service"
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "gear-server.service" not in verify.stdout + verify.stderr, verify.stdout + verify.stderr
    # And it does reject a broken one, so the check above means something.
    broken = tmp_path / "broken" / "gear-server.service"
    broken.parent.mkdir()
    broken.write_text(unit.read_text().replace("Type=notify", "Type=notifyy"))
    bad = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "gear-server.service:" in bad.stdout + bad.stderr and "notifyy" in bad.stdout + bad.stderr


def test_the_example_config_loads_and_documents_every_operations_option():
    settings = load_config(EXAMPLE)
    assert isinstance(settings.checkpoint, CheckpointSettings) and settings.checkpoint.on_stop
    assert isinstance(settings.metrics, MetricsSettings) and settings.metrics.enabled
    assert isinstance(settings.auth, AuthSettings) and settings.auth.load_token() is None
    assert isinstance(settings.logging, LoggingSettings)
    assert isinstance(settings.data_planes, DataPlaneSettings)
    assert settings.metrics.bind == "127.0.0.1"  # a scrape needs no token: this host only unless changed
    text = EXAMPLE.read_text()
    for section, cls in (("checkpoint", CheckpointSettings), ("metrics", MetricsSettings),
                         ("auth", AuthSettings), ("logging", LoggingSettings), ("data_planes", DataPlaneSettings)):
        assert f"[{section}]" in text
        for field in dataclasses.fields(cls):
            assert f"{field.name} =" in text or f"[{section}.{field.name}]" in text, (section, field.name)


def test_the_unit_runs_a_watchdog_and_the_daemon_sends_keep_alives():
    service = _unit(UNIT)["Service"]
    assert 10 <= _seconds(service["WatchdogSec"]) <= 300
    assert "sd_notify.keep_alive" in (ROOT / "gear_server" / "daemon.py").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: the systemd package)")
def test_systemd_analyze_security_scores_the_installed_unit_at_most_4(tmp_path):
    """The rendered unit, as install-service.sh installs it (7.5 EXPOSED before the hardening)."""
    result = _stage(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    unit = tmp_path / "root/etc/systemd/system/gear-server.service"
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                         capture_output=True, text=True, timeout=60)
    if "--offline" in out.stderr and "unrecognized" in out.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert match, out.stdout + out.stderr
    assert float(match.group(1)) <= 4.0, out.stdout
    service = _unit(unit)["Service"]
    # What the hardening must leave reachable: IP and Unix sockets, netlink for rdma-core, the devices.
    assert service["RestrictAddressFamilies"].split() == ["AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"]
    assert service["DevicePolicy"] == "closed" and service["ReadWritePaths"] == "/dev/shm"


def test_docs_and_the_install_script_ask_for_python_311():
    for path in (DEPLOY / "install-service.sh", ROOT / "docs" / "OPERATIONS.md", ROOT / "README.md"):
        text = path.read_text()
        assert not re.search(r"3\.10\b|22\.04", text), path
    assert "(3, 11)" in (DEPLOY / "install-service.sh").read_text()
