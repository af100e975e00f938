"""Writing one checkpoint atomically: files into a temporary directory, fsync'd, renamed, marked complete.

Every file and directory is fsync'd before the rename into place, and the
``COMPLETE`` marker (the manifest's SHA-256) is written last: a directory
without it is never loaded. An interrupted write leaves only the temporary
directory, which ``Checkpointer`` removes. Naming, retention and the one-at-a-time
lock are ``Checkpointer``'s (``gear_server.checkpoint.checkpointer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from gear_server.checkpoint.files import DIR_MODE, FileWriter, create_private, fsync_dir
from gear_server.checkpoint.format import COMPLETE, FORMAT, MANIFEST, VERSION, TableState, encode_tree, table_dir


@dataclass(frozen=True)
class WrittenCheckpoint:
    """A checkpoint just written: where it is, how many tables and bytes it holds."""

    path: Path
    num_tables: int
    total_bytes: int


def write_checkpoint(tmp: Path, final: Path, states: Iterable[TableState], started: float,
                     pause_s: float = 0.0) -> WrittenCheckpoint:
    """Write ``states`` into ``tmp``, then rename it to ``final`` and mark it complete.

    ``pause_s``: sleep after each file (the test hook that lets a test kill the writer midway).
    On any error ``tmp`` is removed and the error raised.
    """
    writer = FileWriter(tmp, pause_s)
    try:
        tmp.mkdir(mode=DIR_MODE)
        os.chmod(tmp, DIR_MODE)
        tables = [_write_table(writer, index, table) for index, table in enumerate(states)]
        manifest = {
            "format": FORMAT, "version": VERSION, "name": final.name,
            "created_unix": started, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "host": socket.gethostname(), "numpy": np.__version__,
            "total_bytes": writer.total, "tables": tables, "files": writer.entries,
        }
        text = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True).encode()
        writer.write(MANIFEST, (text,))
        for sub in sorted({p.parent for p in tmp.rglob("*") if p.is_file()}, key=lambda p: -len(p.parts)):
            fsync_dir(sub)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        marker = {"manifest_sha256": hashlib.sha256(text).hexdigest(), "completed_unix": time.time()}
        with create_private(final / COMPLETE) as f:
            f.write(json.dumps(marker).encode())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        writer.close()
    return WrittenCheckpoint(final, len(tables), writer.total)


def _write_table(writer: FileWriter, index: int, table: TableState) -> dict[str, Any]:
    """One table's files (its state tree's arrays and bytes, its config); returns its manifest entry."""
    prefix = table_dir(index, table.config.name)
    files: dict[str, Any] = {}
    tree = encode_tree(table.state, prefix, files)
    extra = encode_tree(table.extra, prefix + "/extra", files)
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
