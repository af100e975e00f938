"""Checkpoints: every table's state written atomically to disk, and the newest good one restored.

A checkpoint is a directory ``ckpt-<seq>-<UTC time>`` under the checkpoint
root holding raw ``.npy`` files (numpy's header plus the raw buffer, never
pickle), ``config.pb`` files (serialized gear.v1.TableConfig), a
``manifest.json`` that names every file with its size and SHA-256, and a
``COMPLETE`` marker holding the manifest's SHA-256. It is written into
``.tmp-<name>``, every file and the directory fsync'd, renamed into place, and
the marker written last; a directory without the marker is never loaded.
Restore walks the checkpoints newest first and takes the first whose every
byte checks out; a refused one is logged with the reason, marked ``REFUSED``
and kept for inspection. docs/CHECKPOINT_FORMAT.md describes the format.

This module is the ``Checkpointer``: naming, listing, retention, refusal and
choosing what to restore. The format is ``checkpoint_format``, the files
``checkpoint_files``, one write ``checkpoint_write``, one verified read
``checkpoint_read``, the ``[checkpoint]`` section ``checkpoint_settings``.

Test hook: ``GEAR_CHECKPOINT_TEST_PAUSE_S=<seconds>`` in the daemon's
environment makes the writer sleep after each file it writes, so a test can
kill the daemon in the middle of a checkpoint. Never set it in production.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gear_server.checkpoint.files import create_private, make_private_dirs
from gear_server.checkpoint.format import COMPLETE, MANIFEST, REFUSED, CheckpointError, TableState
from gear_server.checkpoint.read import load_checkpoint
from gear_server.checkpoint.settings import CheckpointSettings
from gear_server.checkpoint.write import write_checkpoint

__all__ = ["COMPLETE", "MANIFEST", "REFUSED", "TEST_PAUSE_ENV", "CheckpointDirInUse", "CheckpointError",
           "CheckpointSettings", "Checkpointer", "TableState", "make_private_dirs"]

log = logging.getLogger(__name__)

TEST_PAUSE_ENV = "GEAR_CHECKPOINT_TEST_PAUSE_S"
_NAME = re.compile(r"^ckpt-(\d{6,})-(\d{8}T\d{6}Z)$")
_TMP_PREFIX = ".tmp-"


class CheckpointDirInUse(OSError):
    """Another live daemon uses this checkpoint directory (two daemons would rotate each other's away)."""


def _flock_holder(st: os.stat_result) -> str:
    """The pid holding a flock on the file of ``st`` (from /proc/locks), or "?" when it cannot be told."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted:
                    return fields[4]
    except OSError:
        pass
    return "?"


def _stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


class Checkpointer:
    """Writes checkpoints under ``root``, keeps the newest ``keep``, restores the newest good one."""

    def __init__(self, root: str | os.PathLike, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._lock = threading.Lock()  # one checkpoint at a time
        self.last_written_bytes = 0
        self._dir_lock: int | None = None

    def create_root(self) -> None:
        """Create the checkpoint directory (and missing parents) 0700; OSError when it cannot be."""
        make_private_dirs(self.root)

    def lock_dir(self) -> None:
        """Take the directory for this process (an exclusive ``flock`` on the directory itself, held until
        ``unlock_dir`` or exit); CheckpointDirInUse naming the holder when another live process has it."""
        if self._dir_lock is not None:
            return
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _flock_holder(os.fstat(fd))
            os.close(fd)
            raise CheckpointDirInUse(
                errno.EBUSY, f"checkpoint dir {self.root} is in use by another running daemon (pid {holder}): give "
                             f"each daemon its own directory ([checkpoint] dir or --checkpoint-dir)") from None
        except BaseException:
            os.close(fd)
            raise
        self._dir_lock = fd

    def unlock_dir(self) -> None:
        """Let the directory go (the daemon stopped). Idempotent."""
        fd, self._dir_lock = self._dir_lock, None
        if fd is not None:
            os.close(fd)

    # -- listing ----------------------------------------------------------------

    def _entries(self) -> list[tuple[int, Path]]:
        """(seq, path) of every ckpt-* directory, newest first."""
        out = []
        if not self.root.is_dir():
            return out
        for path in self.root.iterdir():
            match = _NAME.match(path.name)
            if match and path.is_dir():
                out.append((int(match.group(1)), path))
        return sorted(out, reverse=True)

    def complete(self) -> list[Path]:
        """Checkpoints with a completion marker and not refused, newest first."""
        return [p for _, p in self._entries() if (p / COMPLETE).is_file() and not (p / REFUSED).exists()]

    def latest(self) -> Path | None:
        found = self.complete()
        return found[0] if found else None

    def _next_seq(self) -> int:
        seqs = [seq for seq, _ in self._entries()]
        if self.root.is_dir():
            for path in self.root.iterdir():
                match = _NAME.match(path.name[len(_TMP_PREFIX):]) if path.name.startswith(_TMP_PREFIX) else None
                if match:
                    seqs.append(int(match.group(1)))
        return max(seqs, default=0) + 1

    # -- writing ----------------------------------------------------------------

    def write(self, states: Iterable[TableState]) -> Path:
        """Write one checkpoint of ``states``; returns its final path. Old ones beyond ``keep`` go."""
        with self._lock:
            started = time.time()
            self.create_root()
            name = f"ckpt-{self._next_seq():06d}-{_stamp(started)}"
            pause = float(os.environ.get(TEST_PAUSE_ENV, "0") or 0)
            written = write_checkpoint(self.root / f"{_TMP_PREFIX}{name}", self.root / name, states, started, pause)
            self.last_written_bytes = written.total_bytes
            self._prune()
            log.info("checkpoint written path=%s tables=%d bytes=%d seconds=%.3f",
                     written.path, written.num_tables, written.total_bytes, time.time() - started)
            return written.path

    def _prune(self) -> None:
        """Delete complete checkpoints beyond ``keep`` and leftovers of interrupted writes."""
        kept = self.complete()
        newest_seq = int(_NAME.match(kept[0].name).group(1)) if kept else None
        for path in kept[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)
            log.info("checkpoint removed (keep=%d) path=%s", self.keep, path)
        for seq, path in self._entries():
            if not (path / COMPLETE).exists() and not (path / REFUSED).exists() and \
                    newest_seq is not None and seq < newest_seq:
                shutil.rmtree(path, ignore_errors=True)
                log.info("incomplete checkpoint removed path=%s", path)
        for path in self.root.iterdir():
            if path.name.startswith(_TMP_PREFIX) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                log.info("interrupted checkpoint removed path=%s", path)

    def cleanup_interrupted(self) -> list[Path]:
        """Remove temporary directories of checkpoints a crash interrupted (call at start)."""
        removed = []
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith(_TMP_PREFIX) and path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                    log.info("interrupted checkpoint removed path=%s", path)
        return removed

    # -- reading ----------------------------------------------------------------

    @staticmethod
    def load(path: str | os.PathLike) -> list[TableState]:
        """Read and verify one checkpoint; CheckpointError says exactly what is wrong (``checkpoint_read``)."""
        return load_checkpoint(path)

    def refuse(self, path: Path, reason: str) -> None:
        """Mark a checkpoint as refused (kept for inspection, never loaded or counted again)."""
        try:
            with create_private(path / REFUSED) as f:
                f.write((reason + "\n").encode())
        except OSError as exc:
            log.warning("cannot mark %s refused: %s", path, exc)

    def load_latest(self, fallback: str | os.PathLike | None = None,
                    apply: Callable[[Path, list[TableState]], Any] | None = None) -> tuple[Path, Any] | None:
        """The newest checkpoint that verifies and applies, as ``(path, apply(path, states))``.

        A checkpoint whose bytes fail verification is logged, marked REFUSED and
        skipped; one that verifies but cannot be applied (``apply`` raises
        CheckpointError or ValueError) is logged and skipped. ``fallback`` is
        tried when the root holds no usable checkpoint. None when nothing
        can be restored. Without ``apply`` the result is the list of states.
        """
        apply = apply or (lambda path, states: states)
        candidates = [(path, True) for path in self.complete()]
        if fallback:
            fallback = Path(fallback)
            if (fallback / MANIFEST).exists() or not fallback.is_dir():
                candidates.append((fallback, False))
            else:  # another daemon's checkpoint root: its checkpoints, newest first
                candidates.extend((path, False) for path in Checkpointer(fallback).complete())
        for path, ours in candidates:
            try:
                states = self.load(path)
            except CheckpointError as exc:
                log.error("checkpoint refused: %s", exc)
                if ours:
                    self.refuse(path, str(exc))
                continue
            try:
                return path, apply(path, states)
            except (CheckpointError, ValueError, KeyError, IndexError) as exc:
                log.error("checkpoint %s cannot be restored, trying an older one: %s", path, exc)
        for _, path in self._entries():
            if not (path / COMPLETE).exists() and not (path / REFUSED).exists():
                log.warning("checkpoint ignored: %s has no %s marker (its write was interrupted)", path, COMPLETE)
        return None
