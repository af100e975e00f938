"""The checkpoint format: its file names, what it holds per table, and state trees as files plus JSON.

docs/CHECKPOINT_FORMAT.md describes the format; ``checkpoint_write`` writes it,
``checkpoint_read`` verifies and reads it back.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb

FORMAT = "gear-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
REFUSED = "REFUSED"


class CheckpointError(Exception):
    """A checkpoint cannot be written or is refused at restore (the message says why)."""


@dataclass
class TableState:
    """What a checkpoint holds for one table: its config and Table.snapshot()'s state tree."""

    config: pb.TableConfig
    state: Any
    extra: dict[str, Any] = field(default_factory=dict)


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


def encode_tree(node: Any, prefix: str, files: dict[str, Any], path: tuple[str, ...] = ()) -> Any:
    """The JSON form of ``node``; its arrays and bytes are added to ``files`` under names below ``prefix``."""
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
            return {k: encode_tree(v, prefix, files, (*path, *k.split("/"))) for k, v in node.items()}
        return {"$items": [[encode_tree(k, prefix, files, (*path, str(i), "key")),
                            encode_tree(v, prefix, files, (*path, str(i)))] for i, (k, v) in enumerate(node.items())]}
    if isinstance(node, list | tuple):
        return [encode_tree(v, prefix, files, (*path, str(i))) for i, v in enumerate(node)]
    if node is None or isinstance(node, bool | int | float | str):
        return node
    raise CheckpointError(f"{'/'.join(path)}: cannot checkpoint a value of type {type(node).__name__}")


def decode_tree(node: Any, load: Callable[[str, str], Any]) -> Any:
    """A state tree back from its JSON form; ``load(name, "array" | "bytes")`` reads its files."""
    if isinstance(node, dict):
        if "$array" in node:
            return load(node["$array"], "array")
        if "$bytes" in node:
            return load(node["$bytes"], "bytes")
        if "$items" in node:
            return {_hashable(decode_tree(k, load)): decode_tree(v, load) for k, v in node["$items"]}
        return {k: decode_tree(v, load) for k, v in node.items()}
    if isinstance(node, list):
        return [decode_tree(v, load) for v in node]
    return node


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def table_dir(index: int, name: str) -> str:
    """The folder of the ``index``-th table's files inside a checkpoint."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:48] or "table"
    return f"tables/{index:04d}-{safe}"
