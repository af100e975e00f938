"""Items as the daemon receives them, and the one validator every item passes.

``ItemToInsert`` is what the control plane (or any other insert path) builds;
``ItemToInsert.validated()`` runs :func:`prepare_item` once and caches the
result, so the insert path can refuse a bad item before it touches any table
(the InsertStream checks every item of a request first) and the table does not
check it a second time. The checks that depend on a table - its signature, or
the column layout it learned from its first item - live here too
(:class:`Signature`, :func:`layout_mismatch`), so "is this item acceptable" is
answered in one module.

Wire pieces the items are made of are checked here as well: dtypes
(:func:`dtype_from_wire`, the same rule for chunks and items), raw tensors
(:func:`tensor_to_array`) and nest structures (:func:`check_structure`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.priorities import check_priority

# Structure nesting deeper than this is refused (a request must not exhaust the stack).
MAX_STRUCTURE_DEPTH = 64
# numpy arrays have at most 64 dimensions.
MAX_RANK = 64

# dtype kinds that may cross the wire and live in a table: bool, ints, floats, complex, fixed strings.
_ALLOWED_KINDS = frozenset("biufcSU")


class BadRequest(ValueError):
    """The request or item is not valid (INVALID_ARGUMENT)."""


# --------------------------------------------------------------------------- wire pieces


def check_dtype(dtype: np.dtype, where: str) -> np.dtype:
    """``dtype`` if items may hold it: plain numeric, bool or fixed-size string (BadRequest otherwise)."""
    if (dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None
            or dtype.itemsize == 0):
        raise BadRequest(f"{where}: unsupported dtype {dtype.str!r} (plain numeric, bool or fixed-size string only)")
    return dtype


def dtype_from_wire(text: str, where: str) -> np.dtype:
    """The numpy dtype of a wire dtype string; only plain fixed-size types cross the wire."""
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{where}: invalid dtype {text!r}") from e
    return check_dtype(dtype, where)


def tensor_to_array(tensor: pb.Tensor, where: str, min_rank: int = 0) -> np.ndarray:
    """A read-only array over a Tensor's raw buffer, after checking dtype, shape and size."""
    dtype = dtype_from_wire(tensor.dtype, where)
    shape = tuple(tensor.shape)
    if len(shape) > MAX_RANK:
        raise BadRequest(f"{where}: rank {len(shape)} > {MAX_RANK} (the most dimensions an array may have)")
    if len(shape) < min_rank:
        raise BadRequest(f"{where}: rank {len(shape)} < {min_rank} (the first dimension counts steps)")
    if any(d < 0 for d in shape):
        raise BadRequest(f"{where}: negative dimension in shape {shape}")
    expected = dtype.itemsize * math.prod(shape)
    data = tensor.data
    if len(data) != expected:
        raise BadRequest(f"{where}: data holds {len(data)} bytes, shape {shape} of {dtype.str} needs {expected}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def check_structure(structure: pb.Structure, where: str, depth: int = 0) -> int:
    """Validate a wire Structure; returns its number of leaves."""
    if depth > MAX_STRUCTURE_DEPTH:
        raise BadRequest(f"{where}: structure nested deeper than {MAX_STRUCTURE_DEPTH}")
    kind = structure.kind
    k = pb.Structure.Kind
    if kind == k.LEAF or kind == k.NONE:
        if structure.children:
            raise BadRequest(f"{where}: a leaf or None node has children")
        return 1 if kind == k.LEAF else 0
    if kind in (k.DICT, k.NAMEDTUPLE):
        if len(structure.keys) != len(structure.children):
            raise BadRequest(f"{where}: {len(structure.keys)} keys for {len(structure.children)} children")
        if kind == k.NAMEDTUPLE and not structure.type_name.isidentifier():
            raise BadRequest(f"{where}: invalid namedtuple type name {structure.type_name!r}")
    elif kind not in (k.LIST, k.TUPLE):
        raise BadRequest(f"{where}: unknown structure kind {kind}")
    return sum(check_structure(c, where, depth + 1) for c in structure.children)


def count_leaves(structure: pb.Structure) -> int:
    if structure.kind == pb.Structure.LEAF:
        return 1
    return sum(count_leaves(c) for c in structure.children)


def leaf_paths(structure: pb.Structure) -> list[str]:
    """Names of the leaves in depth-first order: dict keys / field names / indices joined by '/'."""
    out: list[str] = []

    def walk(node: pb.Structure, prefix: str) -> None:
        if node.kind == pb.Structure.LEAF:
            out.append(prefix)
            return
        for i, child in enumerate(node.children):
            if node.kind in (pb.Structure.DICT, pb.Structure.NAMEDTUPLE) and i < len(node.keys):
                part = node.keys[i]
            else:
                part = str(i)
            walk(child, f"{prefix}/{part}" if prefix else part)

    walk(structure, "")
    return [p or f"leaf{i}" for i, p in enumerate(out)]


def priority_updates(updates: Mapping[int, float] | Iterable[tuple[int, float]] | None
                     ) -> tuple[list[int], np.ndarray]:
    """(keys, priorities float64) of a priority update, as given (``check_priorities`` checks them)."""
    if updates is None:
        return [], np.zeros(0)
    if isinstance(updates, Mapping):
        keys = list(updates.keys())
        return keys, np.fromiter(updates.values(), np.float64, len(keys))
    pairs = list(updates)
    return [k for k, _ in pairs], np.array([float(p) for _, p in pairs], np.float64)


# --------------------------------------------------------------------------- items


@dataclass(frozen=True)
class ColumnSpec:
    """What one column of a table's items holds: name, dtype, step shape, squeezed or not."""

    name: str
    dtype: np.dtype
    step_shape: tuple[int, ...]
    squeeze: bool

    @property
    def key(self) -> tuple[np.dtype, tuple[int, ...], bool]:
        return (self.dtype, self.step_shape, self.squeeze)

    def to_json(self) -> dict[str, Any]:
        """The spec as checkpoint scalars (docs/CHECKPOINT_FORMAT.md: ``columns``, ``side_items``)."""
        return {"name": self.name, "dtype": self.dtype.str, "shape": list(self.step_shape), "squeeze": self.squeeze}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ColumnSpec:
        """The inverse of ``to_json`` (extra keys, such as a column's ``max_length``, are ignored)."""
        return cls(value["name"], np.dtype(value["dtype"]), tuple(value["shape"]), bool(value["squeeze"]))


@dataclass
class PreparedItem:
    """A validated item, normalised for the table."""

    key: int
    priority: float
    pieces: list[list[np.ndarray]]  # per column, arrays of [t, *shape] (squeeze: one [1, *shape])
    lengths: list[int]
    specs: list[tuple[np.dtype, tuple[int, ...], bool]]  # per column (dtype, step shape, squeeze)
    episode_ids: tuple[int, ...]
    structure: pb.Structure
    resend: bool = False  # a writer's resend after a reconnect: an existing key stays as it is


@dataclass
class ItemToInsert:
    """One item as an insert path hands it to the table.

    ``columns[i]`` is leaf i of ``structure`` (depth-first): ``[T, *shape]``, or
    ``[*shape]`` when ``squeeze[i]``. A non-squeezed column may also be given as a
    sequence of arrays whose steps are concatenated (chunk slices), saving a copy.
    """

    key: int
    priority: float
    structure: pb.Structure
    columns: list[np.ndarray]
    squeeze: list[bool]
    episode_ids: frozenset[int] = frozenset()
    resend: bool = False  # a writer's resend after a reconnect (PrioritizedItem.resend)
    _prepared: PreparedItem | None = field(default=None, init=False, repr=False, compare=False)

    def validated(self) -> PreparedItem:
        """The item checked and normalised (:func:`prepare_item`, run once); ValueError if it is not valid."""
        if self._prepared is None:
            self._prepared = prepare_item(self)
        return self._prepared


@dataclass
class ReservedItem:
    """An item an insert-plane writer wrote into a reserved slot (the table commits it)."""

    key: int
    priority: float
    slot: int
    lengths: list[int]  # steps written, per column (squeezed columns: 1)
    episode_ids: tuple[int, ...] = ()


def check_key(key: object) -> int:
    """An item key as int: a uint64 (BadRequest otherwise)."""
    try:
        value = int(key)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"item key {key!r} is not an integer") from e
    if not 0 <= value < 2**64:
        raise BadRequest(f"item key {key} is not a uint64")
    return value


def prepare_item(item: ItemToInsert) -> PreparedItem:
    """Every check an item needs that does not depend on a table; normalises columns to [t, *shape] pieces."""
    key = check_key(item.key)
    priority = check_priority(item.priority, f"priority of item {key}")
    columns = item.columns
    squeeze = item.squeeze
    if len(columns) == 0:
        raise BadRequest(f"item {key}: empty trajectory: it must have columns")
    if len(squeeze) != len(columns):
        raise BadRequest(f"item {key}: {len(columns)} columns but {len(squeeze)} squeeze flags")
    n_leaves = check_structure(item.structure, f"item {key}")
    if n_leaves != len(columns):
        raise BadRequest(f"item {key}: structure has {n_leaves} leaves but the item has {len(columns)} columns")

    paths: list[str] = []  # the leaves' names, worked out once (per column they made wide items quadratic)

    def label(c: int) -> str:
        if not paths:
            paths.extend(leaf_paths(item.structure))
        return f"item {key}: column '{paths[c]}' (#{c})"

    pieces, lengths, specs = [], [], []
    for c in range(len(columns)):
        col = columns[c]
        if isinstance(col, np.ndarray):
            parts = [col]
        elif isinstance(col, (list, tuple)) and col and all(isinstance(p, np.ndarray) for p in col):
            parts = list(col)
        else:
            raise BadRequest(f"{label(c)} must be a numpy array or a list of them")
        first = parts[0]
        if first.dtype.hasobject:
            raise BadRequest(f"{label(c)} has object dtype")
        check_dtype(first.dtype, label(c))
        if squeeze[c]:
            if len(parts) != 1:
                raise BadRequest(f"{label(c)} is squeezed and must be one array")
            specs.append((first.dtype, first.shape, True))
            pieces.append([first.reshape(1, *first.shape)])
            lengths.append(1)
            continue
        if first.ndim < 1:
            raise BadRequest(f"{label(c)} has no time dimension (use squeeze for single steps)")
        step_shape = first.shape[1:]
        t = first.shape[0]
        for p in parts[1:]:
            if p.dtype != first.dtype or p.shape[1:] != step_shape:
                raise BadRequest(f"{label(c)}: its pieces disagree in dtype or step shape "
                                 f"({first.dtype}{list(step_shape)} vs {p.dtype}{list(p.shape[1:])})")
            t += p.shape[0]
        if t == 0:
            raise BadRequest(f"{label(c)} is empty (length 0)")
        specs.append((first.dtype, step_shape, False))
        pieces.append(parts if len(parts) == 1 else [p for p in parts if p.shape[0]])
        lengths.append(int(t))
    episodes = tuple(sorted({int(e) for e in item.episode_ids})) if item.episode_ids else ()
    return PreparedItem(key, priority, pieces, lengths, specs, episodes, item.structure, item.resend)


# --------------------------------------------------------------------------- against a table


def _shape_matches(shape: tuple[int, ...], spec: Sequence[int]) -> bool:
    return len(shape) == len(spec) and all(s < 0 or s == d for d, s in zip(shape, spec, strict=True))


def _fmt_spec(spec: Sequence[int]) -> str:
    return "[" + ", ".join("?" if s < 0 else str(s) for s in spec) + "]"


def structure_difference(got: pb.Structure, want: pb.Structure) -> str:
    """The first column where an item's structure departs from the table's, in words."""
    got_paths, want_paths = leaf_paths(got), leaf_paths(want)
    for c, (g, w) in enumerate(zip(got_paths, want_paths, strict=False)):
        if g != w:
            return f"column '{g}' (#{c}) is where the table has column '{w}'"
    if len(got_paths) > len(want_paths):
        c = len(want_paths)
        return f"column '{got_paths[c]}' (#{c}) is not in the table's structure"
    if len(got_paths) < len(want_paths):
        c = len(got_paths)
        return f"the item lacks the table's column '{want_paths[c]}' (#{c})"
    return "same columns, but nested in different containers (dict/list/tuple/namedtuple)"


def structure_mismatch(prep: PreparedItem, structure: pb.Structure) -> str | None:
    """Why the item's structure is not ``structure`` (None when it is)."""
    if prep.structure == structure:
        return None
    return (f"item {prep.key}: structure does not match the table's: {structure_difference(prep.structure, structure)}"
            f" (leaves {leaf_paths(prep.structure)} vs {leaf_paths(structure)})")


def unknown_key(got: pb.Structure, want: pb.Structure, prefix: str = "",
                depth: int = 0) -> tuple[str, list[str]] | None:
    """The first key of ``got`` (as a '/'-joined path) where ``want`` names its children without it, with
    ``want``'s keys at that place; None when every such key is known. Only places where both name their
    children are compared (a list against a dict, or a leaf against a nest, is the flattened leaves' business)."""
    named = (pb.Structure.DICT, pb.Structure.NAMEDTUPLE)
    sequences = (pb.Structure.LIST, pb.Structure.TUPLE)
    if depth > MAX_STRUCTURE_DEPTH:
        return None
    if got.kind in named and want.kind in named:
        wanted = dict(zip(want.keys, want.children, strict=False))
        for key, child in zip(got.keys, got.children, strict=False):
            path = f"{prefix}/{key}" if prefix else key
            if key not in wanted:
                return path, list(want.keys)
            found = unknown_key(child, wanted[key], path, depth + 1)
            if found is not None:
                return found
    elif got.kind in sequences and want.kind in sequences and len(got.children) == len(want.children):
        for i, (child, wanted_child) in enumerate(zip(got.children, want.children, strict=True)):
            found = unknown_key(child, wanted_child, f"{prefix}/{i}" if prefix else str(i), depth + 1)
            if found is not None:
                return found
    return None


@dataclass(frozen=True)
class SignatureLeaf:
    dtype: np.dtype
    shape: tuple[int, ...]  # the whole leaf's shape: [T, *step] (T < 0: any length), or the step when squeezed
    name: str


class Signature:
    """A table's signature: its structure and one dtype/shape spec per flattened leaf."""

    def __init__(self, signature: pb.Signature, table: str):
        n = count_leaves(signature.structure)
        if n != len(signature.leaves):
            raise ValueError(f"table '{table}': signature structure has {n} leaves but {len(signature.leaves)} specs")
        if n == 0:
            raise ValueError(f"table '{table}': signature has no leaves")
        names = leaf_paths(signature.structure)
        leaves = []
        for i, leaf in enumerate(signature.leaves):
            try:
                dtype = np.dtype(leaf.dtype)
            except TypeError as e:
                raise ValueError(f"table '{table}': signature leaf {i} has bad dtype {leaf.dtype!r}") from e
            leaves.append(SignatureLeaf(dtype, tuple(int(d) for d in leaf.shape), leaf.name or names[i]))
        self.proto = pb.Signature()
        self.proto.CopyFrom(signature)
        self.structure: pb.Structure = self.proto.structure
        self.leaves: list[SignatureLeaf] = leaves

    def names(self) -> list[str]:
        return [leaf.name for leaf in self.leaves]

    def fixed_length(self, column: int, step_rank: int) -> int:
        """The time dimension the signature fixes for a column whose steps have ``step_rank`` dimensions
        (-1: any). A spec of one dimension more than a step is the whole trajectory (its first dimension
        the steps, -1 for any number); a spec of a step's rank is one step (Reverb's legacy Writer
        items): any number of steps."""
        shape = self.leaves[column].shape
        return int(shape[0]) if len(shape) == step_rank + 1 else -1

    def check(self, prep: PreparedItem) -> None:
        """ValueError naming the first leaf the signature does not allow.

        As Reverb, the flattened leaves are compared, not the nest's containers (an item
        ``[x]`` fits a signature ``TensorSpec``), and each leaf may match the spec as the
        whole trajectory (``[T, *step]``) or as one step (``step``, every step alike). Where both
        name their children (dicts, namedtuples), the item may use only the signature's keys.
        """
        unknown = unknown_key(prep.structure, self.structure)
        if unknown is not None:
            path, known = unknown
            raise ValueError(f"item {prep.key}: key '{path}' is not in the table's signature (keys there: "
                             f"{', '.join(repr(k) for k in known)})")
        if len(prep.specs) != len(self.leaves):
            raise ValueError(f"item {prep.key} has {len(prep.specs)} flattened leaves ({leaf_paths(prep.structure)}) "
                             f"but the signature has {len(self.leaves)} ({self.names()})")
        for c, ((dtype, step_shape, squeezed), length) in enumerate(zip(prep.specs, prep.lengths, strict=True)):
            leaf = self.leaves[c]
            if dtype != leaf.dtype:
                raise ValueError(f"item {prep.key}: column '{leaf.name}' (#{c}) has dtype {dtype} but the signature "
                                 f"says {leaf.dtype}")
            whole = (1, *step_shape) if squeezed else (length, *step_shape)
            if not (_shape_matches(whole, leaf.shape) or _shape_matches(step_shape, leaf.shape)):
                raise ValueError(f"item {prep.key}: column '{leaf.name}' (#{c}) has shape {list(whole)} (steps of "
                                 f"{list(step_shape)}) but the signature says {_fmt_spec(leaf.shape)}, as the "
                                 f"whole trajectory or as one step")


def layout_mismatch(prep: PreparedItem, specs: Sequence[ColumnSpec]) -> str | None:
    """Why the item's columns do not fit a learned column layout (None when they do)."""
    if [s.key for s in specs] == prep.specs:
        return None
    if len(specs) != len(prep.specs):
        return f"item {prep.key} has {len(prep.specs)} columns but the table's items have {len(specs)}"
    for c, ((dtype, step_shape, squeezed), fixed) in enumerate(zip(prep.specs, specs, strict=True)):
        label = f"item {prep.key}: column '{fixed.name}' (#{c})"
        if squeezed != fixed.squeeze:
            return f"{label} is {'' if squeezed else 'not '}squeezed, unlike the table's items"
        if dtype != fixed.dtype:
            return f"{label} has dtype {dtype} but the table holds {fixed.dtype}"
        if step_shape != fixed.step_shape:
            return f"{label} has step shape {list(step_shape)} but the table holds {list(fixed.step_shape)}"
    return None
