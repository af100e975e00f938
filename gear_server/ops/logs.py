"""Logging for the daemon: levels from config, journald-friendly lines, client errors in aggregate.

One line per significant event (start, restore, table created, checkpoint,
stop). Under systemd (``$JOURNAL_STREAM`` set) each line starts with a
``<N>`` syslog priority that journald turns into the entry's level, and
carries no timestamp (the journal adds one). Failed client calls are counted
and summarised once per interval instead of flooding the log.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gear_server.config import known_keys

log = logging.getLogger("gear_server")

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Codes a client's own call can end with that say nothing is wrong with the daemon.
_QUIET_CODES = frozenset({"OK", "CANCELLED"})
_SERVER_FAULT_CODES = frozenset({"UNKNOWN", "INTERNAL", "DATA_LOSS", "UNIMPLEMENTED"})
# Bounds of the failed-call summary: (method, code) pairs listed per line (the rest are
# counted together) and characters of a method or code name (callers choose method names).
MAX_SUMMARY_ENTRIES = 32
MAX_NAME_CHARS = 64
OTHER_CALLS = ("(other calls)", "any code")


@dataclass(frozen=True)
class LoggingSettings:
    """The ``[logging]`` section."""

    level: str = "INFO"
    format: str = "auto"  # "auto": journal under systemd, else text; "journal"; "text"
    loggers: Mapping[str, str] = field(default_factory=dict)  # per-logger levels, e.g. {"grpc" = "WARNING"}
    client_error_summary_s: float = 60.0  # interval of the failed-call summary line (0: off)

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> LoggingSettings:
        section = known_keys(section, cls.__dataclass_fields__, "[logging]")
        level = str(section.get("level", cls.level)).upper()
        if level not in LEVELS:
            raise ValueError(f"[logging] level must be one of {LEVELS}, got {section.get('level')!r}")
        fmt = section.get("format", cls.format)
        if fmt not in ("auto", "journal", "text"):
            raise ValueError(f"[logging] format must be auto, journal or text, got {fmt!r}")
        loggers = section.get("loggers", {})
        if not isinstance(loggers, Mapping):
            raise ValueError("[logging.loggers] must be a table of logger = level")
        for name, value in loggers.items():
            if str(value).upper() not in LEVELS:
                raise ValueError(f"[logging.loggers] {name} = {value!r}: level must be one of {LEVELS}")
        interval = section.get("client_error_summary_s", cls.client_error_summary_s)
        if not isinstance(interval, int | float) or isinstance(interval, bool) or interval < 0:
            raise ValueError(f"[logging] client_error_summary_s must be a number >= 0, got {interval!r}")
        return cls(level=level, format=fmt, loggers={k: str(v).upper() for k, v in loggers.items()},
                   client_error_summary_s=float(interval))


class JournalFormatter(logging.Formatter):
    """``<priority>logger: message``: journald reads the priority and stamps the time."""

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        priority = self._PRIORITY.get(record.levelno, 6)
        text = super().format(record).replace("\n", "\n" + f"<{priority}>  ")
        return f"<{priority}>{text}"


def configure_logging(settings: LoggingSettings | None = None) -> None:
    """Install one stderr handler on the root logger with the configured levels and format."""
    settings = settings or LoggingSettings()
    fmt = settings.format
    if fmt == "auto":
        fmt = "journal" if os.environ.get("JOURNAL_STREAM") else "text"
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "journal":
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                                               datefmt="%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_gear", False):
            root.removeHandler(old)
    handler._gear = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(settings.level)
    for name, level in settings.loggers.items():
        logging.getLogger(name).setLevel(level)


def _bounded(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."


class ErrorSummary:
    """Counts failed calls by (method, status code) and logs them as one line per interval.

    Bounded whatever callers send: at most ``MAX_SUMMARY_ENTRIES`` distinct pairs
    are kept per interval (later ones are counted as "(other calls)") and names
    are cut at ``MAX_NAME_CHARS``, so the memory held and the line written stay small.
    """

    def __init__(self, interval_s: float = 60.0, logger: logging.Logger | None = None) -> None:
        self._interval = interval_s
        self._log = logger or log
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, method: str, code: str) -> None:
        if code in _QUIET_CODES:
            return
        key = (_bounded(method), _bounded(code))
        with self._lock:
            if key not in self._counts and len(self._counts) >= MAX_SUMMARY_ENTRIES:
                key = OTHER_CALLS
            self._counts[key] += 1

    def flush(self) -> str | None:
        """Log (and return) the summary of calls failed since the last flush; None if none."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        if not counts:
            return None
        parts = ", ".join(f"{method} {code} x{n}" for (method, code), n in counts.most_common())
        total = sum(counts.values())
        line = f"failed calls in the last {self._interval:g} s: {total} ({parts})"
        faulty = any(code in _SERVER_FAULT_CODES for _, code in counts)
        self._log.log(logging.WARNING if faulty else logging.INFO, line)
        return line

    def start(self) -> None:
        if self._interval <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="gear-error-summary", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def stop(self) -> None:
        """Stop the timer and log what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.flush()
