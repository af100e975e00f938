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

Test hook: ``GEAR_CHECKPOINT_TEST_PAUSE_S=<seconds>`` in the daemon's
environment makes the writer sleep after each file it writes, so a test can
kill the daemon in the middle of a checkpoint. Never set it in production.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from gear_contract._proto import replay_pb2 as pb
from gear_server.config import known_keys

log = logging.getLogger(__name__)

FORMAT = "gear-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
REFUSED = "REFUSED"
TEST_PAUSE_ENV = "GEAR_CHECKPOINT_TEST_PAUSE_S"
_NAME = re.compile(r"^ckpt-(\d{6,})-(\d{8}T\d{6}Z)$")
_TMP_PREFIX = ".tmp-"
_CHUNK = 64 << 20  # bytes hashed (in a helper thread) while the previous chunk is written
_FLUSH_EVERY = 256 << 20  # big files: start writing back to the disk before the end


class CheckpointError(Exception):
    """A checkpoint cannot be written or is refused at restore (the message says why)."""


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``[checkpoint]`` section."""

    dir: str | None = None           # where checkpoints live (None: the ServerConfig's checkpoint_dir)
    interval_s: float = 0.0          # periodic checkpoints every this many seconds (0: off)
    keep: int = 3                    # complete checkpoints kept; older ones are deleted
    on_stop: bool = True             # write a final checkpoint on SIGTERM / stop
    restore: bool = True             # restore the newest good checkpoint at start
    fallback_path: str | None = None  # one checkpoint to restore when `dir` holds none

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> CheckpointSettings:
        section = known_keys(section, cls.__dataclass_fields__, "[checkpoint]")
        for key in ("dir", "fallback_path"):
            if key in section and (not isinstance(section[key], str) or not section[key]):
                raise ValueError(f"[checkpoint] {key} must be a non-empty path, got {section[key]!r}")
        interval = section.get("interval_s", 0.0)
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
            raise ValueError(f"[checkpoint] interval_s must be a number >= 0, got {interval!r}")
        keep = section.get("keep", cls.keep)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"[checkpoint] keep must be an integer >= 1, got {keep!r}")
        for key in ("on_stop", "restore"):
            if key in section and not isinstance(section[key], bool):
                raise ValueError(f"[checkpoint] {key} must be true or false, got {section[key]!r}")
        return cls(dir=section.get("dir"), interval_s=float(interval), keep=keep,
                   on_stop=section.get("on_stop", True), restore=section.get("restore", True),
                   fallback_path=section.get("fallback_path"))

    @classmethod
    def effective(cls, settings: CheckpointSettings | None, server: pb.ServerConfig) -> CheckpointSettings:
        """The section merged with what the ServerConfig says (the Python Server sets checkpoint_dir)."""
        settings = settings or cls()
        updates: dict[str, Any] = {}
        if settings.dir is None and server.checkpoint_dir:
            updates["dir"] = server.checkpoint_dir
        fallback = getattr(server, "fallback_checkpoint_path", "")
        if settings.fallback_path is None and fallback:
            updates["fallback_path"] = fallback
        return cls(**{**settings.__dict__, **updates}) if updates else settings


@dataclass
class TableState:
    """What a checkpoint holds for one table: its config and Table.snapshot()'s state tree."""

    config: pb.TableConfig
    state: Any
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------- encoding ----
# A state tree is made of dicts, lists, tuples, str, int, float, bool, None,
# bytes, numpy scalars and numpy arrays. Arrays and bytes go to files named
# after their place in the tree; the rest is JSON in the manifest, arrays
# replaced by {"$array": file}, bytes by {"$bytes": file}, dicts with
# non-string keys by {"$items": [[k, v], ...]}.

def _component(text: str) -> str:
    """One file-name-safe path component (no separators, no leading dots)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).lstrip(".")[:64] or "_"


def _file_name(prefix: str, path: tuple[str, ...], suffix: str, files: dict[str, Any]) -> str:
    base = "/".join([prefix, *(_component(p) for p in path)]) if path else f"{prefix}/value"
    name, n = base + suffix, 1
    while name in files:  # two tree paths that sanitise alike
        name, n = f"{base}~{n}{suffix}", n + 1
    return name


def _encode(node: Any, prefix: str, files: dict[str, Any], path: tuple[str, ...] = ()) -> Any:
    if isinstance(node, np.ndarray):
        if node.dtype.hasobject:
            raise CheckpointError(f"{'/'.join(path)}: object arrays cannot be checkpointed (no pickle)")
        name = _file_name(prefix, path, ".npy", files)
        files[name] = node
        return {"$array": name}
    if isinstance(node, bytes | bytearray | memoryview):
        name = _file_name(prefix, path, ".bin", files)
        files[name] = bytes(node)
        return {"$bytes": name}
    if isinstance(node, np.generic):
        return node.item()
    if isinstance(node, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in node):
            return {k: _encode(v, prefix, files, (*path, *k.split("/"))) for k, v in node.items()}
        return {"$items": [[_encode(k, prefix, files, (*path, str(i), "key")),
                            _encode(v, prefix, files, (*path, str(i)))] for i, (k, v) in enumerate(node.items())]}
    if isinstance(node, list | tuple):
        return [_encode(v, prefix, files, (*path, str(i))) for i, v in enumerate(node)]
    if node is None or isinstance(node, bool | int | float | str):
        return node
    raise CheckpointError(f"{'/'.join(path)}: cannot checkpoint a value of type {type(node).__name__}")


def _decode(node: Any, load: Callable[[str, str], Any]) -> Any:
    if isinstance(node, dict):
        if "$array" in node:
            return load(node["$array"], "array")
        if "$bytes" in node:
            return load(node["$bytes"], "bytes")
        if "$items" in node:
            return {_hashable(_decode(k, load)): _decode(v, load) for k, v in node["$items"]}
        return {k: _decode(v, load) for k, v in node.items()}
    if isinstance(node, list):
        return [_decode(v, load) for v in node]
    return node


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


# -------------------------------------------------------------------- files ----

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


def _create_private(path: Path):
    """A new file opened for writing, mode 0600 from its creation on (never readable by others)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an earlier file of that name kept its mode through O_TRUNC
    return open(fd, "wb", buffering=0)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_npy(path: Path, hasher: concurrent.futures.Executor) -> tuple[np.ndarray, str]:
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


class _Writer:
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
        with _create_private(path) as f:
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


# ------------------------------------------------------------- checkpointer ----

def _stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def _table_dir(index: int, name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:48] or "table"
    return f"tables/{index:04d}-{safe}"


class Checkpointer:
    """Writes checkpoints under ``root``, keeps the newest ``keep``, restores the newest good one."""

    def __init__(self, root: str | os.PathLike, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._lock = threading.Lock()  # one checkpoint at a time
        self.last_written_bytes = 0

    def create_root(self) -> None:
        """Create the checkpoint directory (and missing parents) 0700; OSError when it cannot be."""
        make_private_dirs(self.root)

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
            tmp = self.root / f"{_TMP_PREFIX}{name}"
            final = self.root / name
            pause = float(os.environ.get(TEST_PAUSE_ENV, "0") or 0)
            writer = _Writer(tmp, pause)
            try:
                tmp.mkdir(mode=DIR_MODE)
                os.chmod(tmp, DIR_MODE)
                tables = []
                for index, table in enumerate(states):
                    tables.append(self._write_table(writer, index, table))
                manifest = {
                    "format": FORMAT, "version": VERSION, "name": name,
                    "created_unix": started, "created": time.strftime(
                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                    "host": socket.gethostname(), "numpy": np.__version__,
                    "total_bytes": writer.total, "tables": tables, "files": writer.entries,
                }
                text = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True).encode()
                writer.write(MANIFEST, (text,))
                for sub in sorted({p.parent for p in tmp.rglob("*") if p.is_file()}, key=lambda p: -len(p.parts)):
                    _fsync_dir(sub)
                os.rename(tmp, final)
                _fsync_dir(self.root)
                marker = {"manifest_sha256": hashlib.sha256(text).hexdigest(), "completed_unix": time.time()}
                with _create_private(final / COMPLETE) as f:
                    f.write(json.dumps(marker).encode())
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_dir(final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                writer.close()
            self.last_written_bytes = writer.total
            self._prune()
            log.info("checkpoint written path=%s tables=%d bytes=%d seconds=%.3f",
                     final, len(tables), writer.total, time.time() - started)
            return final

    def _write_table(self, writer: _Writer, index: int, table: TableState) -> dict[str, Any]:
        prefix = _table_dir(index, table.config.name)
        files: dict[str, Any] = {}
        tree = _encode(table.state, prefix, files)
        extra = _encode(table.extra, prefix + "/extra", files)
        arrays = {}
        for name, value in files.items():
            if isinstance(value, np.ndarray):
                arrays[name] = writer.write_array(name, value)
            else:
                writer.write(name, (value,))
        config_file = f"{prefix}/config.pb"
        writer.write(config_file, (table.config.SerializeToString(),))
        return {
            "name": table.config.name, "config_file": config_file,
            "config": json_format.MessageToDict(table.config, preserving_proto_field_name=True),
            "state": tree, "extra": extra, "arrays": arrays,
        }

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
        """Read and verify one checkpoint; CheckpointError says exactly what is wrong."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory")
        marker_path = path / COMPLETE
        if not marker_path.is_file():
            raise CheckpointError(f"{path}: incomplete (no {COMPLETE} marker): the write was interrupted")
        try:
            marker = json.loads(marker_path.read_bytes())
            text = (path / MANIFEST).read_bytes()
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read {COMPLETE} or {MANIFEST}: {exc}") from exc
        if not isinstance(marker, dict) or hashlib.sha256(text).hexdigest() != marker.get("manifest_sha256"):
            raise CheckpointError(f"{path}: {MANIFEST} does not match the checksum in {COMPLETE} (corrupted)")
        try:
            manifest = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON: {exc}") from exc
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise CheckpointError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
                                  f"is not {FORMAT!r} version {VERSION}")
        files: dict[str, dict[str, Any]] = manifest["files"]
        root = path.resolve()

        def verified_path(name: str) -> Path:
            entry = files.get(name)
            if entry is None:
                raise CheckpointError(f"{path}: {name} is referenced but not listed in {MANIFEST}")
            file = (path / name).resolve()
            if root not in file.parents:
                raise CheckpointError(f"{path}: {name} points outside the checkpoint")
            try:
                size = file.stat().st_size
            except OSError as exc:
                raise CheckpointError(f"{path}: {name} is missing: {exc.strerror or exc}") from exc
            if size != entry["bytes"]:
                raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {entry['bytes']} "
                                      f"(truncated or corrupted)")
            return file

        def check_digest(name: str, digest: str) -> None:
            if digest != files[name]["sha256"]:
                raise CheckpointError(f"{path}: {name} fails its SHA-256 check (corrupted)")

        def load_file(name: str, kind: str) -> Any:
            file = verified_path(name)
            if kind == "bytes":
                data = file.read_bytes()
                check_digest(name, hashlib.sha256(data).hexdigest())
                return data
            try:
                array, digest = _read_npy(file, hasher)
            except (ValueError, OSError) as exc:
                raise CheckpointError(f"{path}: {name} is not a valid .npy file: {exc}") from exc
            check_digest(name, digest)
            return array

        hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gear-ckpt-hash")
        try:
            return Checkpointer._load_tables(path, manifest, load_file)
        finally:
            hasher.shutdown(wait=True)

    @staticmethod
    def _load_tables(path: Path, manifest: dict[str, Any], load_file: Callable[[str, str], Any]) -> list[TableState]:
        states = []
        for entry in manifest["tables"]:
            config = pb.TableConfig()
            try:
                config.ParseFromString(load_file(entry["config_file"], "bytes"))
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{path}: {entry['config_file']} is not a TableConfig: {exc}") from exc
            arrays = entry.get("arrays", {})

            def load_checked(name: str, kind: str, arrays=arrays) -> Any:
                value = load_file(name, kind)
                meta = arrays.get(name)
                if kind == "array" and meta is not None and (
                        value.dtype.str != meta["dtype"] or list(value.shape) != meta["shape"]):
                    raise CheckpointError(f"{path}: {name} holds {value.dtype.str}{list(value.shape)}, "
                                          f"the manifest says {meta['dtype']}{meta['shape']}")
                return value

            state = _decode(entry["state"], load_checked)
            extra = _decode(entry.get("extra", {}), load_checked)
            states.append(TableState(config=config, state=state, extra=extra))
        return states

    def refuse(self, path: Path, reason: str) -> None:
        """Mark a checkpoint as refused (kept for inspection, never loaded or counted again)."""
        try:
            with _create_private(path / REFUSED) as f:
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
