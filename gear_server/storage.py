"""Named shared-memory segments that hold the tables' bytes.

Every table lives in one segment per layout version: a file under ``shm_dir``
(``/dev/shm`` by default) named ``gear.<instance>.<pid>.<table>.v<version>``,
created exclusively with mode 0600, sized with ``ftruncate`` and mapped. Learners
on the same host map the same file read-only (shm data plane); the daemon
unlinks its segments when it stops, and removes those of dead daemons of the
same instance when it starts.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import threading

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_INSTANCE_OK = re.compile(r"^[A-Za-z0-9_-]+$")


def sanitise_table_name(table: str, max_chars: int = 48) -> str:
    """A file-name-safe, unique spelling of a table name (readable part + hash suffix)."""
    readable = _UNSAFE.sub("_", table)[:max_chars] or "table"
    digest = hashlib.sha1(table.encode("utf-8")).hexdigest()[:8]
    return f"{readable}-{digest}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (EPERM counts as alive: it is someone's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the segment's pages now, so a full tmpfs fails here (ENOSPC) rather than
    with SIGBUS at the first write into a page that cannot be backed."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # the filesystem cannot reserve; stay lazy
        raise OSError(e.errno, f"cannot reserve {size} bytes for segment {path}: {e.strerror}") from e


class Segment:
    """One mapped segment file. ``buffer`` is the writable mapping."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, path)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)
        self.closed = False

    @property
    def buffer(self) -> mmap.mmap:
        return self._mmap

    def close(self) -> None:
        """Unlink the file and unmap it (if no array still views it; then the GC unmaps it later)."""
        if self.closed:
            return
        self.closed = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self._mmap.close()
        except BufferError:
            # numpy views still export the buffer (e.g. a reader mid-copy); the mapping
            # goes away with the last of them. The file is already unlinked.
            pass


class SegmentStore:
    """Creates, tracks and removes this daemon's segments."""

    def __init__(self, shm_dir: str = "/dev/shm", instance: str = "gear"):
        if not _INSTANCE_OK.match(instance):
            raise ValueError(f"instance name {instance!r} may only hold letters, digits, '_' and '-'")
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory")
        self.shm_dir = shm_dir
        self.instance = instance
        self.pid = os.getpid()
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def segment_path(self, table: str, version: int) -> str:
        name = f"gear.{self.instance}.{self.pid}.{sanitise_table_name(table)}.v{int(version)}"
        return os.path.join(self.shm_dir, name)

    def create(self, table: str, version: int, size: int) -> Segment:
        """Create (exclusively, mode 0600) and map a segment of at least ``size`` bytes."""
        size = max(int(size), mmap.PAGESIZE)
        path = self.segment_path(table, version)
        segment = Segment(path, size)
        with self._lock:
            self._segments[path] = segment
        return segment

    def release(self, segment: Segment) -> None:
        """Unlink and unmap one segment (e.g. the old one after growth)."""
        with self._lock:
            self._segments.pop(segment.path, None)
        segment.close()

    def cleanup_stale(self) -> list[str]:
        """Remove segments of this instance whose daemon pid is dead; returns the removed paths."""
        prefix = f"gear.{self.instance}."
        removed = []
        for name in os.listdir(self.shm_dir):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            pid_text = rest.split(".", 1)[0]
            if not pid_text.isdigit():
                continue
            pid = int(pid_text)
            if pid == self.pid or pid_alive(pid):
                continue
            path = os.path.join(self.shm_dir, name)
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        return removed

    def close(self) -> None:
        """Unlink every segment this store created and still holds."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
        for segment in segments:
            segment.close()

    def paths(self) -> list[str]:
        with self._lock:
            return sorted(self._segments)
