"""sd_notify over a real Unix datagram socket; logging setup and the failed-call summary."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading

import pytest

from gear_server.ops import sd_notify
from gear_server.ops.logs import ErrorSummary, LoggingSettings


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_ready_status_stopping_reach_the_notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sd_notify.status("restoring checkpoint")
        assert sd_notify.ready("serving 2 tables")
        assert sd_notify.extend_timeout(90)
        assert sd_notify.stopping()
        messages = [sock.recv(4096).decode() for _ in range(4)]
    assert messages[0] == "STATUS=restoring checkpoint"
    assert messages[1].split("\n") == ["READY=1", "STATUS=serving 2 tables"]
    assert messages[2] == "EXTEND_TIMEOUT_USEC=90000000"
    assert messages[3] == "STOPPING=1"


def test_abstract_socket_and_no_socket(monkeypatch):
    name = f"gear-test-{os.getpid()}"
    with _receiver("\0" + name) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify.ready()
        assert sock.recv(4096).decode() == "READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd_notify.ready() is False  # outside systemd: a no-op


def test_a_dead_notify_socket_is_a_warning_not_a_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    with caplog.at_level(logging.WARNING):
        assert sd_notify.ready() is False
    assert "sd_notify" in caplog.text


def _log_in_child(env: dict[str, str], settings: str) -> str:
    code = ("import logging; from gear_server.ops.logs import LoggingSettings, configure_logging; "
            f"configure_logging(LoggingSettings.from_toml({settings})); "
            "logging.getLogger('gear_server.daemon').info('checkpoint written path=/x'); "
            "logging.getLogger('gear_server.daemon').debug('hidden'); "
            "logging.getLogger('grpc').warning('quiet'); logging.getLogger('gear_server').error('bad')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_journal_lines_carry_syslog_priorities_and_levels_come_from_config():
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    journal = _log_in_child({**env, "JOURNAL_STREAM": "8:1234"}, "{'level': 'info', 'loggers': {'grpc': 'error'}}")
    assert journal.splitlines() == ["<6>gear_server.daemon: checkpoint written path=/x", "<3>gear_server: bad"]
    text = _log_in_child(env, "{'level': 'DEBUG'}")
    lines = text.splitlines()
    assert len(lines) == 4 and " INFO gear_server.daemon: checkpoint written path=/x" in lines[0]
    assert lines[0][:4].isdigit() and "DEBUG" in lines[1]


def test_logging_settings_are_checked():
    with pytest.raises(ValueError, match="level must be one of"):
        LoggingSettings.from_toml({"level": "LOUD"})
    with pytest.raises(ValueError, match="format"):
        LoggingSettings.from_toml({"format": "xml"})
    with pytest.raises(ValueError, match="unknown key"):
        LoggingSettings.from_toml({"lvl": "INFO"})
    assert LoggingSettings.from_toml({"level": "warning"}).level == "WARNING"


def test_error_summary_aggregates_and_grades(caplog):
    summary = ErrorSummary(interval_s=0.05, logger=logging.getLogger("gear_server.test"))
    with caplog.at_level(logging.INFO, logger="gear_server.test"):
        for _ in range(3):
            summary.record("Sample", "NOT_FOUND")
        summary.record("Sample", "CANCELLED")  # a client hanging up is not an error
        summary.record("InsertStream", "INVALID_ARGUMENT")
        summary.start()
        for _ in range(100):
            if caplog.records:
                break
            threading.Event().wait(0.02)
        summary.record("Select", "INTERNAL")
        summary.stop()
    assert len(caplog.records) == 2
    first, second = caplog.records
    assert first.levelno == logging.INFO
    assert "4 (Sample NOT_FOUND x3, InsertStream INVALID_ARGUMENT x1)" in first.getMessage()
    assert second.levelno == logging.WARNING and "Select INTERNAL x1" in second.getMessage()



def test_error_summary_stays_bounded_whatever_callers_send(caplog):
    """10,000 made-up method names (long ones too) make one short line, not one entry each."""
    summary = ErrorSummary(interval_s=60)
    for i in range(10_000):
        summary.record(f"MadeUp{i}" + "x" * (i % 3) * 500, "UNIMPLEMENTED")
    with caplog.at_level(logging.INFO, logger="gear_server"):
        line = summary.flush()
    assert line is not None and "10000 (" in line
    assert len(line) < 4096, len(line)
    assert "(other calls) any code x" in line


def test_watchdog_keep_alives_follow_watchdog_usec(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        assert sd_notify.watchdog_interval() is None and not sd_notify.keep_alive()
        monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # WatchdogSec=2s: a keep-alive every second
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
        assert sd_notify.watchdog_interval() is None and not sd_notify.keep_alive()
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        assert sd_notify.watchdog_interval() == 1.0
        assert sd_notify.keep_alive(now=1000.0)
        assert not sd_notify.keep_alive(now=1000.5)  # not due yet
        assert sd_notify.keep_alive(now=1001.0)
        assert [sock.recv(64) for _ in range(2)] == [b"WATCHDOG=1", b"WATCHDOG=1"]


def test_the_asyncio_keep_alive_task_pings_until_cancelled(tmp_path, monkeypatch):
    import asyncio

    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s: a keep-alive every 0.1 s
        monkeypatch.delenv("WATCHDOG_PID", raising=False)

        async def serve_for_a_while() -> None:
            task = asyncio.create_task(sd_notify.keep_alive_forever())
            await asyncio.sleep(0.55)
            task.cancel()

        asyncio.run(serve_for_a_while())
        sock.settimeout(0.2)
        pings = []
        try:
            while True:
                pings.append(sock.recv(64))
        except TimeoutError:
            pass
    assert set(pings) == {b"WATCHDOG=1"} and 3 <= len(pings) <= 7, pings


def test_a_serving_daemon_sends_watchdog_keep_alives(tmp_path):
    """Under WatchdogSec= (WATCHDOG_USEC) the daemon pings while it serves; a wedged loop would stop them."""
    import uuid

    from tests.support.daemon_process import DaemonProcess
    from tests.support.tables_toml import tables_toml

    daemon = DaemonProcess(tmp_path, tables_toml(f"wd{uuid.uuid4().hex[:8]}"), env={"WATCHDOG_USEC": "1000000"})
    try:
        daemon.wait_ready()
        first = daemon.wait_for("WATCHDOG=1", timeout=10)
        daemon.messages.remove(first)
        daemon.wait_for("WATCHDOG=1", timeout=10)  # and again: it keeps pinging
    finally:
        assert daemon.stop() == 0
