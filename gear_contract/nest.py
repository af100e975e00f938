"""Nested Python structures: flatten, rebuild, and their wire form (gear.v1.Structure).

A nest is a dict (or any Mapping; keys sorted), list, tuple, namedtuple or
None, holding leaves (anything else: arrays, scalars, columns, specs).
``None`` is an empty node without leaves. Leaves are numbered depth first,
dict keys in sorted order, as dm-tree and tf.nest do, so Reverb code that
flattens its own data sees the same order.

The wire form carries no pickle: namedtuples travel as their type name and
field names and are rebuilt as namedtuples of that name on the other side
(the original class when this process has seen it).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from gear_contract._proto import replay_pb2 as pb

__all__ = [
    "is_namedtuple",
    "is_nested",
    "flatten",
    "flatten_with_paths",
    "flatten_with_treedef",
    "structure_of",
    "unflatten",
    "pack_as",
    "map_structure",
    "assert_same_structure",
    "num_leaves",
    "namedtuple_class",
]

_Kind = pb.Structure.Kind
_LEAF_KIND, _DICT, _LIST, _TUPLE, _NAMEDTUPLE, _NONE = (
    pb.Structure.LEAF, pb.Structure.DICT, pb.Structure.LIST, pb.Structure.TUPLE, pb.Structure.NAMEDTUPLE,
    pb.Structure.NONE,
)


def is_namedtuple(x: Any) -> bool:
    """True for namedtuple instances (a tuple with ``_fields``)."""
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_nested(x: Any) -> bool:
    """True when ``x`` is a node (dict, list, tuple, namedtuple, None), not a leaf."""
    return x is None or isinstance(x, (Mapping, list, tuple))


def _sorted_keys(mapping: Mapping) -> list:
    try:
        return sorted(mapping)
    except TypeError as e:
        raise TypeError(f"dict keys of a nest must be sortable, got {list(mapping)!r}") from e


def flatten(nest: Any) -> list:
    """The leaves of ``nest`` in depth-first order (dict keys sorted)."""
    out: list = []
    _flatten_into(nest, out)
    return out


def _flatten_into(nest: Any, out: list) -> None:
    if nest is None:
        return
    if isinstance(nest, Mapping):
        for k in _sorted_keys(nest):
            _flatten_into(nest[k], out)
    elif isinstance(nest, (list, tuple)):
        for v in nest:
            _flatten_into(v, out)
    else:
        out.append(nest)


def flatten_with_treedef(nest: Any) -> tuple[list, Any]:
    """The leaves and a hashable description of the structure (equal for equal structures).

    Lets callers cache per structure (e.g. the wire Structure) at the cost of one walk.
    """
    out: list = []
    return out, _treedef_into(nest, out)


def _treedef_into(nest: Any, out: list) -> Any:
    t = type(nest)
    if t is dict or (t is not list and t is not tuple and isinstance(nest, Mapping)):
        keys = _sorted_keys(nest)
        return (dict, tuple(keys), tuple([_treedef_into(nest[k], out) for k in keys]))
    if nest is None:
        return None
    if t is list or t is tuple or isinstance(nest, (list, tuple)):
        return (t, tuple([_treedef_into(v, out) for v in nest]))
    out.append(nest)
    return 0


def flatten_with_paths(nest: Any, *, none_is_leaf: bool = False) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` pairs; a path is the tuple of keys/indices from the root.

    With ``none_is_leaf`` a None counts as a leaf (the writers use this: None
    marks a field without data in this step).
    """
    out: list[tuple[tuple, Any]] = []

    def walk(node: Any, path: tuple) -> None:
        if node is None:
            if none_is_leaf:
                out.append((path, None))
            return
        if isinstance(node, Mapping):
            for k in _sorted_keys(node):
                walk(node[k], path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))
        else:
            out.append((path, node))

    walk(nest, ())
    return out


def structure_of(nest: Any) -> pb.Structure:
    """The wire form of ``nest``'s structure (leaves dropped)."""
    msg = pb.Structure()
    _fill_structure(msg, nest)
    return msg


def _fill_structure(msg: pb.Structure, nest: Any) -> None:
    # Filled in place: nesting messages through constructor arguments copies them.
    if nest is None:
        msg.kind = _NONE
    elif isinstance(nest, Mapping):
        keys = _sorted_keys(nest)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"dict keys must be str to cross the wire, got {k!r} ({type(k).__name__})")
        msg.kind = _DICT
        msg.keys.extend(keys)
        for k in keys:
            _fill_structure(msg.children.add(), nest[k])
    elif isinstance(nest, (list, tuple)):
        if is_namedtuple(nest):
            _remember_namedtuple(type(nest))
            msg.kind = _NAMEDTUPLE
            msg.type_name = type(nest).__name__
            msg.keys.extend(type(nest)._fields)
        else:
            msg.kind = _TUPLE if isinstance(nest, tuple) else _LIST
        for v in nest:
            _fill_structure(msg.children.add(), v)
    # else: a leaf, kind LEAF (0) is the default


def num_leaves(structure: pb.Structure) -> int:
    """How many leaves a wire structure holds."""
    if structure.kind == _Kind.LEAF:
        return 1
    return sum(num_leaves(c) for c in structure.children)


# ------------------------------------------------------------ namedtuples ----

_namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}
_namedtuples_lock = threading.Lock()


def _remember_namedtuple(cls: type) -> None:
    key = (cls.__name__, tuple(cls._fields))
    if _namedtuples.get(key) is not cls:
        with _namedtuples_lock:
            _namedtuples[key] = cls


def namedtuple_class(type_name: str, fields: Sequence[str]) -> type:
    """The namedtuple class for a wire (name, fields): one seen here, else a new one."""
    key = (type_name, tuple(fields))
    cls = _namedtuples.get(key)
    if cls is not None:
        return cls
    with _namedtuples_lock:
        cls = _namedtuples.get(key)
        if cls is None:
            try:
                cls = collections.namedtuple(type_name, key[1])
            except ValueError as e:
                raise ValueError(f"cannot rebuild namedtuple {type_name!r} with fields {key[1]!r}: {e}") from e
            _namedtuples[key] = cls
    return cls


# ---------------------------------------------------------------- rebuild ----

_Builder = Callable[[Iterator], Any]
_builders: dict[bytes, tuple[int, _Builder]] = {}
_MAX_CACHED_BUILDERS = 1024


def _compile(s: pb.Structure) -> _Builder:
    """A function taking a leaf iterator and returning the nest, for one structure."""
    kind = s.kind
    if kind == _Kind.LEAF:
        return next
    if kind == _Kind.NONE:
        return lambda it: None
    children = [_compile(c) for c in s.children]
    if kind == _Kind.DICT:
        keys = list(s.keys)
        if len(keys) != len(children):
            raise ValueError(f"malformed Structure: {len(keys)} keys for {len(children)} children")
        pairs = list(zip(keys, children, strict=True))
        return lambda it: {k: b(it) for k, b in pairs}
    if kind == _Kind.LIST:
        return lambda it: [b(it) for b in children]
    if kind == _Kind.TUPLE:
        return lambda it: tuple(b(it) for b in children)
    if kind == _Kind.NAMEDTUPLE:
        if len(s.keys) != len(children):
            raise ValueError(f"malformed Structure: {len(s.keys)} fields for {len(children)} children")
        cls = namedtuple_class(s.type_name, list(s.keys))
        return lambda it: cls(*[b(it) for b in children])
    raise ValueError(f"malformed Structure: unknown kind {kind}")


def _builder(structure: pb.Structure) -> tuple[int, _Builder]:
    key = structure.SerializeToString(deterministic=True)
    entry = _builders.get(key)
    if entry is None:
        entry = (num_leaves(structure), _compile(structure))
        if len(_builders) >= _MAX_CACHED_BUILDERS:
            _builders.clear()
        _builders[key] = entry
    return entry


def unflatten(structure: pb.Structure, leaves: Sequence) -> Any:
    """Rebuild the nest of a wire ``structure`` from its leaves (inverse of flatten)."""
    n, build = _builder(structure)
    if len(leaves) != n:
        raise ValueError(f"structure has {n} leaves, got {len(leaves)}")
    return build(iter(leaves))


def pack_as(reference: Any, leaves: Sequence) -> Any:
    """Rebuild a nest shaped like the Python nest ``reference`` (same container types)."""
    it = iter(leaves)
    out = _pack(reference, it)
    rest = sum(1 for _ in it)
    if rest:
        raise ValueError(f"{rest} leaves more than the structure holds")
    return out


def _pack(ref: Any, it: Iterator) -> Any:
    if ref is None:
        return None
    if isinstance(ref, Mapping):
        values = {k: _pack(ref[k], it) for k in _sorted_keys(ref)}
        if type(ref) is dict:
            return values
        try:
            return type(ref)(values)
        except TypeError:
            return values
    if is_namedtuple(ref):
        return type(ref)(*[_pack(v, it) for v in ref])
    if isinstance(ref, (list, tuple)):
        return type(ref)(_pack(v, it) for v in ref)
    try:
        return next(it)
    except StopIteration:
        raise ValueError("fewer leaves than the structure holds") from None


# ------------------------------------------------------------ comparisons ----

def assert_same_structure(a: Any, b: Any, check_types: bool = True) -> None:
    """Raise ValueError (TypeError for container types) unless a and b have the same structure."""
    _compare(a, b, (), check_types)


def _node_kind(x: Any) -> str:
    if x is None:
        return "None"
    if isinstance(x, Mapping):
        return "dict"
    if is_namedtuple(x):
        return "namedtuple"
    if isinstance(x, tuple):
        return "tuple"
    if isinstance(x, list):
        return "list"
    return "leaf"


def _compare(a: Any, b: Any, path: tuple, check_types: bool) -> None:
    ka, kb = _node_kind(a), _node_kind(b)
    if ka != kb:
        if not check_types and {ka, kb} <= {"list", "tuple"}:
            pass
        else:
            raise ValueError(f"structures differ at {path or 'the root'}: {ka} vs {kb}")
    if ka == "leaf" or ka == "None":
        return
    if ka == "dict":
        keys_a, keys_b = _sorted_keys(a), _sorted_keys(b)
        if keys_a != keys_b:
            raise ValueError(f"structures differ at {path or 'the root'}: keys {keys_a} vs {keys_b}")
        for k in keys_a:
            _compare(a[k], b[k], path + (k,), check_types)
        return
    if ka == "namedtuple" and check_types and (type(a).__name__, a._fields) != (type(b).__name__, b._fields):
        raise TypeError(f"structures differ at {path or 'the root'}: {type(a).__name__} vs {type(b).__name__}")
    if len(a) != len(b):
        raise ValueError(f"structures differ at {path or 'the root'}: length {len(a)} vs {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        _compare(x, y, path + (i,), check_types)


def map_structure(fn: Callable[..., Any], *nests: Any) -> Any:
    """Apply ``fn`` to corresponding leaves of nests of the same structure."""
    if not nests:
        raise ValueError("map_structure needs at least one nest")
    for other in nests[1:]:
        assert_same_structure(nests[0], other)
    flats = [flatten(n) for n in nests]
    return pack_as(nests[0], [fn(*xs) for xs in zip(*flats, strict=True)])
