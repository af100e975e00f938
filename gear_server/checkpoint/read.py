"""Reading one checkpoint back, every byte verified: marker, manifest, sizes, SHA-256s, dtypes and shapes.

A checkpoint is refused (``CheckpointError`` saying exactly what is wrong) if
its ``COMPLETE`` marker is missing, the manifest does not match the marker's
checksum or is not this format, a file is missing, points outside the
checkpoint, has another size or hash than the manifest says, or an array holds
another dtype or shape. Which checkpoint to read is ``Checkpointer``'s choice.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gear_contract._proto import replay_pb2 as pb
from gear_server.checkpoint.files import read_npy
from gear_server.checkpoint.format import COMPLETE, FORMAT, MANIFEST, VERSION, CheckpointError, TableState, decode_tree


def load_checkpoint(path: str | os.PathLike) -> list[TableState]:
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
            array, digest = read_npy(file, hasher)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{path}: {name} is not a valid .npy file: {exc}") from exc
        check_digest(name, digest)
        return array

    hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gear-ckpt-hash")
    try:
        return _load_tables(path, manifest, load_file)
    finally:
        hasher.shutdown(wait=True)

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

        state = decode_tree(entry["state"], load_checked)
        extra = decode_tree(entry.get("extra", {}), load_checked)
        states.append(TableState(config=config, state=state, extra=extra))
    return states
