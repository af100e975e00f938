"""A checkpoint's files on disk: private modes, fsync, and .npy files hashed while they are written or read.

Checkpoints hold every table's data, so every file is created 0600 and every
directory 0700. Files are written and read in chunks, each hashed (SHA-256, in
a helper thread: hashlib releases the GIL) while the next one moves. Only
numpy's own format code writes and parses .npy headers; object dtypes (which
numpy would unpickle) are refused.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

_CHUNK = 64 << 20  # bytes hashed (in a helper thread) while the previous chunk is written
_FLUSH_EVERY = 256 << 20  # big files: start writing back to the disk before the end

# Checkpoints hold every table's data: readable by the daemon's user only, whatever the
# umask of the shell that started it (the systemd unit's UMask=0077 is not always there).
FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700 (existing ones are left as they are)."""
    missing = []
    for parent in (path, *path.parents):
        if parent.is_dir():
            break
        missing.append(parent)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask


def create_private(path: Path):
    """A new file opened for writing, mode 0600 from its creation on (never readable by others)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an earlier file of that name kept its mode through O_TRUNC
    return open(fd, "wb", buffering=0)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_npy(path: Path, hasher: concurrent.futures.Executor) -> tuple[np.ndarray, str]:
    """An .npy file and its SHA-256, read in chunks hashed while the next one is read.

    Only numpy's format reader parses the header; object dtypes (which numpy
    would unpickle) are refused, as ``np.load(allow_pickle=False)`` does.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
        if dtype.hasobject:
            raise ValueError("object arrays are refused (they would be unpickled)")
        header_len = f.tell()
        f.seek(0)
        digest.update(f.read(header_len))
        array = np.empty(shape, dtype, order="F" if fortran else "C")
        view = memoryview(array.reshape(-1, order="A").view(np.uint8)) if array.size else memoryview(b"")
        pending = None
        for start in range(0, len(view), _CHUNK):
            chunk = view[start:start + _CHUNK]
            if f.readinto(chunk) != len(chunk):
                raise ValueError("the file ends before its data does")
            if pending is not None:
                pending.result()
            pending = hasher.submit(digest.update, chunk)  # hashlib releases the GIL
        if pending is not None:
            pending.result()
        if f.read(1):
            raise ValueError("bytes after the array data")
    return array, digest.hexdigest()


def _npy_header(array: np.ndarray) -> bytes:
    """numpy's .npy header for ``array`` (written by numpy's own format code)."""
    buffer = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:  # a header too long for version 1.0 (huge structured dtypes)
        np.lib.format.write_array_header_2_0(buffer, header)
    return buffer.getvalue()


class FileWriter:
    """Writes files into one checkpoint directory, hashing each chunk while the previous one is written."""

    def __init__(self, root: Path, pause_s: float) -> None:
        self.root = root
        self.pause_s = pause_s
        self.entries: dict[str, dict[str, Any]] = {}
        self.total = 0
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gear-ckpt-hash")
        self._flusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gear-ckpt-flush")

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        self._flusher.shutdown(wait=True)

    def write(self, name: str, pieces: Iterable[memoryview | bytes]) -> None:
        path = self.root / name
        make_private_dirs(path.parent)
        digest = hashlib.sha256()
        size = 0
        pending = flushing = None
        with create_private(path) as f:
            for piece in pieces:
                view = memoryview(piece).cast("B")
                for start in range(0, len(view), _CHUNK):
                    chunk = view[start:start + _CHUNK]
                    if pending is not None:
                        pending.result()
                    pending = self._hasher.submit(digest.update, chunk)  # hashlib releases the GIL
                    while chunk:
                        chunk = chunk[f.write(chunk):]
                    size += len(view[start:start + _CHUNK])
                    if size >= _FLUSH_EVERY and (flushing is None or flushing.done()):
                        # The disk drains what is written so far while the next chunks are hashed.
                        flushing = self._flusher.submit(os.fdatasync, f.fileno())
            if pending is not None:
                pending.result()
            if flushing is not None:
                flushing.result()
            os.fsync(f.fileno())
        self.entries[name] = {"bytes": size, "sha256": digest.hexdigest()}
        self.total += size
        if self.pause_s > 0:
            time.sleep(self.pause_s)

    def write_array(self, name: str, array: np.ndarray) -> dict[str, Any]:
        array = np.ascontiguousarray(array)
        header = _npy_header(array)
        data = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
        self.write(name, (header, data))
        return {"dtype": array.dtype.str, "shape": list(array.shape)}
