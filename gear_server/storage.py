"""Named shared-memory segments that hold the tables' bytes.

Every table lives in one segment per layout version: a file under ``shm_dir``
(``/dev/shm`` by default) named ``gear.<instance>.<pid>.<table>.v<version>``,
created exclusively with mode 0600, sized with ``ftruncate`` and mapped. Learners
on the same host map the same file read-only (shm data plane); the daemon
unlinks its segments when it stops, and removes those of dead daemons (of any
instance), with their ingest sockets, when it starts; it holds a shared
``flock`` on each of its segments, so no other daemon's cleanup takes a live
one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import re
import socket
import stat
import threading

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_INSTANCE_OK = re.compile(r"^[A-Za-z0-9_-]+$")
# gear.<instance>.<pid>.<sanitised table>.v<version>
_SEGMENT_NAME = re.compile(r"^gear\.([A-Za-z0-9_-]+)\.([0-9]+)\.([A-Za-z0-9_-]+)\.v([0-9]+)$")
# gear.<instance>.<pid>.ingest.sock: a daemon's socket for its ingest workers (gear_server.ingest.daemon_hook)
_SOCKET_NAME = re.compile(r"^gear\.([A-Za-z0-9_-]+)\.([0-9]+)\.ingest\.sock$")


def sanitise_table_name(table: str, max_chars: int = 48) -> str:
    """A file-name-safe, unique spelling of a table name (readable part + hash suffix)."""
    readable = _UNSAFE.sub("_", table)[:max_chars] or "table"
    digest = hashlib.sha1(table.encode("utf-8")).hexdigest()[:8]
    return f"{readable}-{digest}"


def _locked_by_someone(path: str) -> bool:
    """Whether a process holds a lock on the file (a live daemon's segment); True when it cannot be checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return True  # another user's file, a link, gone: not ours to judge
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        return False  # closing the descriptor drops the probe's lock
    finally:
        os.close(fd)


def _listened_on(path: str) -> bool:
    """Whether a process listens on the unix socket (a live daemon's); True when it cannot be told."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return True  # not a socket: not ours to judge
    except OSError:
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()


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


class Segment:
    """One mapped segment file. ``buffer`` is the writable mapping.

    The file is sparse: ``ftruncate`` sizes it but commits no memory. ``reserve``
    allocates a byte range (``posix_fallocate``) before anything is written there,
    so a full tmpfs fails that call with ENOSPC instead of killing the daemon with
    SIGBUS at the first write into a page that cannot be backed. ``grow`` makes the
    same file longer under a new name (the mapping is replaced; the bytes stay).
    """

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size
        self._fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # "alive": no daemon's stale cleanup removes it while held
            os.ftruncate(self._fd, size)
            self._mmap = self._map(size)
        except BaseException:
            os.close(self._fd)
            _unlink(path)
            raise
        self.closed = False

    def _map(self, size: int) -> mmap.mmap:
        return mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @property
    def buffer(self) -> mmap.mmap:
        return self._mmap

    def reserve(self, offset: int, length: int) -> None:
        """Allocate ``[offset, offset + length)`` now (OSError ENOSPC/ENOMEM when the shm directory is full)."""
        if length <= 0:
            return
        try:
            os.posix_fallocate(self._fd, offset, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return  # the filesystem cannot reserve; pages are allocated as they are written
            raise

    def allocated_bytes(self) -> int:
        """Bytes of memory the file holds (its allocated blocks), at most ``size`` plus page rounding."""
        return os.fstat(self._fd).st_blocks * 512

    def grow(self, size: int, path: str) -> None:
        """Lengthen the file to ``size`` bytes, rename it to ``path`` and map it whole (bytes kept, none copied).

        Mappings of the old size (readers' views) stay valid: they map the same file.
        """
        if size < self.size:
            raise ValueError(f"segment {self.path}: cannot shrink from {self.size} to {size} bytes")
        os.ftruncate(self._fd, size)
        new_map = self._map(size)
        os.rename(self.path, path)
        old_map, self._mmap, self.path, self.size = self._mmap, new_map, path, size
        _close_map(old_map)

    def close(self) -> None:
        """Unlink the file and unmap it (if no array still views it; then the GC unmaps it later)."""
        if self.closed:
            return
        self.closed = True
        _unlink(self.path)
        os.close(self._fd)
        _close_map(self._mmap)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        # numpy views still export the buffer (e.g. a reader mid-copy); the mapping
        # goes away with the last of them.
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
        """Create (exclusively, mode 0600) and map a sparse segment of at least ``size`` bytes."""
        size = max(int(size), mmap.PAGESIZE)
        path = self.segment_path(table, version)
        segment = Segment(path, size)
        with self._lock:
            self._segments[path] = segment
        return segment

    def grow(self, segment: Segment, table: str, version: int, size: int) -> None:
        """Lengthen ``segment`` to ``size`` bytes in place, renamed for layout ``version``."""
        path = self.segment_path(table, version)
        old = segment.path
        segment.grow(max(int(size), mmap.PAGESIZE), path)
        with self._lock:
            self._segments.pop(old, None)
            self._segments[path] = segment

    def release(self, segment: Segment) -> None:
        """Unlink and unmap one segment (e.g. the old one after growth)."""
        with self._lock:
            self._segments.pop(segment.path, None)
        segment.close()

    def cleanup_stale(self) -> list[str]:
        """Remove segments and ingest sockets left by dead daemons of any instance; returns the removed paths.

        A segment is stale when its name is a daemon segment's (``gear.<instance>.<pid>.<table>.v<n>``),
        the pid in it is not alive here, and no process holds the file's lock (every daemon
        keeps a shared ``flock`` on its segments while they live, so a live daemon in another
        pid namespace sharing the directory keeps its segments). An ingest socket is stale when its pid is
        not alive here and nothing listens on it. Files of other users are left.
        """
        removed = []
        for name in os.listdir(self.shm_dir):
            match = _SEGMENT_NAME.match(name) or _SOCKET_NAME.match(name)
            if match is None:
                continue
            pid = int(match.group(2))
            if pid == self.pid or pid_alive(pid):
                continue
            path = os.path.join(self.shm_dir, name)
            if _locked_by_someone(path) if match.re is _SEGMENT_NAME else _listened_on(path):
                continue
            try:
                os.unlink(path)
                removed.append(path)
            except (FileNotFoundError, PermissionError):
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
