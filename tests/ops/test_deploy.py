"""The systemd unit, the install script and the example config (deploy/)."""

from __future__ import annotations

import configparser
import dataclasses
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gear_server.auth import AuthSettings
from gear_server.checkpoint import CheckpointSettings
from gear_server.config import load_config
from gear_server.logs import LoggingSettings
from gear_server.metrics import MetricsSettings

from ._support import ROOT

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
    assert config.read_text() == EXAMPLE.read_text()
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
    text = EXAMPLE.read_text()
    for section, cls in (("checkpoint", CheckpointSettings), ("metrics", MetricsSettings),
                         ("auth", AuthSettings), ("logging", LoggingSettings)):
        assert f"[{section}]" in text
        for field in dataclasses.fields(cls):
            assert f"{field.name} =" in text or f"[{section}.{field.name}]" in text, (section, field.name)
