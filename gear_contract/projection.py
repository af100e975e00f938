"""Column projection: which of a table's columns a learner wants, and the structure of what it gets.

A table's columns are the leaves of its signature in flattened order. A
learner names the fields it wants by path (``"obs"``, ``"obs/rgb"``, ``"0"`` for
a tuple's first element; a path names one leaf or every leaf under it) or as a
nest of the wanted fields (e.g. ``{"obs": {"rgb": True}}``: every leaf names a
path; a leaf that is None names nothing). The batch it gets has the table's structure pruned to those leaves:
mappings lose the keys not asked for, tuples, lists and namedtuples keep their
length with None where a field was not asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gear_contract._proto import replay_pb2 as pb
from gear_contract.nest import flatten_with_paths

_Kind = pb.Structure.Kind


class UnknownFieldError(ValueError):
    """A wanted path names no field of the table."""


def leaf_paths(structure: pb.Structure) -> list[str]:
    """The path of every leaf of ``structure``, in flattened (column) order ("" for a lone leaf)."""
    out: list[str] = []

    def walk(node: pb.Structure, path: tuple[str, ...]) -> None:
        if node.kind == _Kind.LEAF:
            out.append("/".join(path))
        elif node.kind == _Kind.NONE:
            return
        else:
            names = list(node.keys) if node.kind in (_Kind.DICT, _Kind.NAMEDTUPLE) else None
            for i, child in enumerate(node.children):
                walk(child, path + (names[i] if names else str(i),))

    walk(structure, ())
    return out


def wanted_paths(columns: Any) -> list[str]:
    """The paths named by ``columns``: a path, a list of paths, or a nest of the wanted fields."""
    if isinstance(columns, str):
        return [columns.strip("/")]
    if isinstance(columns, Mapping):
        return ["/".join(str(p) for p in path) for path, _ in flatten_with_paths(columns)]
    if isinstance(columns, Sequence) and all(isinstance(c, str) for c in columns):
        return [c.strip("/") for c in columns]
    raise TypeError(f"columns must be a path, a list of paths or a nest of the wanted fields, got {columns!r}")


def column_indices(structure: pb.Structure, columns: Any) -> list[int]:
    """The (sorted) indices of the columns ``columns`` names; ValueError naming a path that names none."""
    paths = leaf_paths(structure)
    wanted = wanted_paths(columns)
    if not wanted:
        raise UnknownFieldError("columns names no field (give at least one path)")
    chosen: set[int] = set()
    for path in wanted:
        hits = [i for i, p in enumerate(paths) if p == path or path == "" or p.startswith(path + "/")]
        if not hits:
            raise UnknownFieldError(f"unknown field path '{path}': the table's fields are {paths}")
        chosen.update(hits)
    return sorted(chosen)


def check_indices(indices: Sequence[int], num_columns: int) -> list[int]:
    """``indices`` as a sorted list without repeats; ValueError naming one out of [0, num_columns)."""
    for i in indices:
        if not 0 <= int(i) < num_columns:
            raise ValueError(f"column {int(i)} asked for, the table has {num_columns} columns")
    return sorted({int(i) for i in indices})


def prune_structure(structure: pb.Structure, indices: Sequence[int]) -> pb.Structure:
    """``structure`` with only the leaves at ``indices`` (flattened order), as the module docstring says."""
    keep = set(int(i) for i in indices)
    counter = [0]

    def prune(node: pb.Structure) -> pb.Structure | None:
        if node.kind == _Kind.LEAF:
            index = counter[0]
            counter[0] += 1
            return pb.Structure() if index in keep else None
        if node.kind == _Kind.NONE:
            return None
        kept = [prune(child) for child in node.children]
        if all(k is None for k in kept):
            return None
        out = pb.Structure(kind=node.kind, type_name=node.type_name)
        if node.kind == _Kind.DICT:
            for key, child in zip(node.keys, kept, strict=True):
                if child is not None:
                    out.keys.append(key)
                    out.children.add().CopyFrom(child)
            return out
        out.keys.extend(node.keys)
        for child in kept:
            out.children.add().CopyFrom(child if child is not None else pb.Structure(kind=_Kind.NONE))
        return out

    pruned = prune(structure)
    return pruned if pruned is not None else pb.Structure(kind=_Kind.NONE)
