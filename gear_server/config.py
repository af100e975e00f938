"""The daemon's configuration: a TOML file -> DaemonSettings (core gear.v1.ServerConfig + operations).

Schema (deploy/gear-server.example.toml shows every key)::

    bind_address = "[::]"          # default
    port = 8000                    # 0: any free port
    shm_dir = "/dev/shm"           # where the tables' segments live
    instance_name = "gear"         # prefix of this daemon's segment names
    max_workers = 8                # threads for table work (copies, selection); waiting calls hold none

    [[tables]]
    name = "replay"
    sampler = "uniform"            # uniform | fifo | lifo | max_heap | min_heap
                                   # or { prioritized = { priority_exponent = 0.8 } }
    remover = "fifo"
    max_size = 100000
    max_times_sampled = 0          # < 1: unlimited
    rate_limiter = { min_size = 1 }
        # or { sample_to_insert_ratio = { samples_per_insert = 4.0, min_size_to_sample = 1000,
        #                                 error_buffer = 100.0 } }   (error_buffer may be [min_diff, max_diff])
        # or "queue" / "stack" (size = max_size)
        # or { explicit = { samples_per_insert = 1.0, min_size_to_sample = 1, min_diff = -1e9, max_diff = 1e9 } }
    initial_max_length = 0         # slot capacity in steps when no signature fixes it (0: learn it)
    [tables.signature]             # optional; nested tables nest; a leaf has dtype and shape
    observation = { dtype = "float32", shape = [-1, 84, 84] }

    [[tables]]
    name = "queue"
    preset = "queue"               # Table.queue: fifo sampler/remover, max_times_sampled 1, Queue(max_size)
    max_size = 1000

Operations sections (``[checkpoint]``, ``[metrics]``, ``[auth]``, ``[logging]``,
``[data_planes]``, ``[limits]``, ``[ingest]``) are
parsed by their own modules (``<module>.<Settings>.from_toml(section)``).

Every mistake is a ``ConfigError`` (a ValueError) naming the key and the table.
"""

from __future__ import annotations

import importlib
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gear_contract import rate_limiters, selectors, specs
from gear_contract._proto import replay_pb2 as pb

__all__ = ["ConfigError", "DaemonSettings", "load_config", "parse_config", "table_config_from_toml"]

DEFAULT_BIND_ADDRESS = "[::]"
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_INSTANCE = "gear"
DEFAULT_MAX_WORKERS = 8

# section -> (module, settings class) of each operations concern.
OPERATION_SECTIONS: dict[str, tuple[str, str]] = {
    "checkpoint": ("gear_server.checkpoint.checkpointer", "CheckpointSettings"),
    "metrics": ("gear_server.ops.metrics", "MetricsSettings"),
    "auth": ("gear_server.ops.auth", "AuthSettings"),
    "logging": ("gear_server.ops.logs", "LoggingSettings"),
    "data_planes": ("gear_server.data_planes.settings", "DataPlaneSettings"),
    "limits": ("gear_server.rpc.limits", "LimitSettings"),
    "ingest": ("gear_server.ingest.settings", "IngestSettings"),
}

_SERVER_KEYS = {"bind_address", "port", "shm_dir", "instance_name", "max_workers", "tables"}
_TABLE_KEYS = {"name", "preset", "sampler", "remover", "max_size", "max_times_sampled", "rate_limiter",
               "signature", "initial_max_length", "gpu_mirror"}
_GPU_MIRROR_KEYS = {"device", "bytes", "backend"}
_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_BYTE_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


@dataclass
class DaemonSettings:
    """Everything a Daemon needs: the core ServerConfig plus one settings object per operations concern."""

    server: pb.ServerConfig
    max_workers: int = DEFAULT_MAX_WORKERS
    checkpoint: Any = None
    metrics: Any = None
    auth: Any = None
    logging: Any = None
    data_planes: Any = None
    limits: Any = None
    ingest: Any = None
    source: str | None = None  # the file it came from, for log lines
    extra: dict[str, Any] = field(default_factory=dict)  # operations sections whose module is absent

    @classmethod
    def from_server_config(cls, config: pb.ServerConfig, max_workers: int = DEFAULT_MAX_WORKERS) -> DaemonSettings:
        """Settings with defaults filled in for a bare ServerConfig (as the Python Server sends)."""
        server = pb.ServerConfig()
        server.CopyFrom(config)
        _fill_defaults(server)
        _check_tables(server)
        return cls(server=server, max_workers=max_workers)


def load_config(path: str | Path) -> DaemonSettings:
    """Read and validate a TOML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    settings = parse_config(data)
    settings.source = str(path)
    return settings


def parse_config(data: dict[str, Any]) -> DaemonSettings:
    """Validate a parsed TOML document and build DaemonSettings."""
    sections = {k: v for k, v in data.items() if k in OPERATION_SECTIONS}
    core = {k: v for k, v in data.items() if k not in OPERATION_SECTIONS}
    unknown = sorted(set(core) - _SERVER_KEYS)
    if unknown:
        known = sorted(_SERVER_KEYS | set(OPERATION_SECTIONS))
        raise ConfigError(f"unknown top-level key(s) {unknown}; known: {known}")
    server = pb.ServerConfig(
        bind_address=_typed(core, "bind_address", str, DEFAULT_BIND_ADDRESS, "top level"),
        port=_int(core, "port", 0, "top level"),
        shm_dir=_typed(core, "shm_dir", str, DEFAULT_SHM_DIR, "top level"),
        instance_name=_typed(core, "instance_name", str, DEFAULT_INSTANCE, "top level"),
    )
    if not 0 <= server.port <= 65535:
        raise ConfigError(f"port must be in [0, 65535], got {server.port}")
    max_workers = _int(core, "max_workers", DEFAULT_MAX_WORKERS, "top level")
    if max_workers < 4:
        raise ConfigError(f"max_workers must be at least 4, got {max_workers}")
    tables = core.get("tables")
    if not isinstance(tables, list) or not tables:
        raise ConfigError("the config needs at least one [[tables]] entry")
    for i, entry in enumerate(tables):
        if not isinstance(entry, dict):
            raise ConfigError(f"tables[{i}] must be a table, got {entry!r}")
        server.tables.append(table_config_from_toml(entry, where=f"tables[{i}]"))
    _check_tables(server)
    settings = DaemonSettings(server=server, max_workers=max_workers)
    for name, section in sections.items():
        if not isinstance(section, dict):
            raise ConfigError(f"[{name}] must be a table, got {section!r}")
        _parse_operations_section(settings, name, section)
    return settings


def _parse_operations_section(settings: DaemonSettings, name: str, section: dict[str, Any]) -> None:
    module_name, class_name = OPERATION_SECTIONS[name]
    try:
        module = importlib.import_module(module_name)
        parser = getattr(module, class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"[{name}] is not supported by this build ({module_name}.{class_name}: {e})") from e
    try:
        setattr(settings, name, parser.from_toml(section))
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"[{name}]: {e}") from e


def _check_tables(server: pb.ServerConfig) -> None:
    seen: set[str] = set()
    for t in server.tables:
        if t.name in seen:
            raise ConfigError(f"two tables are named {t.name!r}")
        seen.add(t.name)


def _fill_defaults(server: pb.ServerConfig) -> None:
    if not server.bind_address:
        server.bind_address = DEFAULT_BIND_ADDRESS
    if not server.shm_dir:
        server.shm_dir = DEFAULT_SHM_DIR
    if not server.instance_name:
        server.instance_name = DEFAULT_INSTANCE


# ------------------------------------------------------------------ tables ----

def table_config_from_toml(entry: dict[str, Any], where: str = "table") -> pb.TableConfig:
    """One ``[[tables]]`` entry -> TableConfig (validated with the client's option classes)."""
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name must be a non-empty string")
    where = f"table {name!r}"
    known_keys(entry, _TABLE_KEYS, where)
    max_size = _int(entry, "max_size", None, where)
    if max_size is None:
        raise ConfigError(f"{where}: max_size is required")
    if max_size <= 0:
        raise ConfigError(f"{where}: max_size ({max_size}) must be a positive integer")
    preset = entry.get("preset")
    if preset is not None:
        if preset not in ("queue", "stack"):
            raise ConfigError(f"{where}: preset must be 'queue' or 'stack', got {preset!r}")
        clash = sorted({"sampler", "remover", "rate_limiter", "max_times_sampled"} & set(entry))
        if clash:
            raise ConfigError(f"{where}: preset {preset!r} fixes {clash}; remove them")
        selector = selectors.Fifo() if preset == "queue" else selectors.Lifo()
        limiter = rate_limiters.Queue(max_size) if preset == "queue" else rate_limiters.Stack(max_size)
        sampler_pb, remover_pb, max_times_sampled = selector.to_proto(), selector.to_proto(), 1
    else:
        for key in ("sampler", "remover", "rate_limiter"):
            if key not in entry:
                raise ConfigError(f"{where}: {key} is required (or use preset = 'queue' / 'stack')")
        sampler_pb = selector_from_toml(entry["sampler"], f"{where} sampler")
        remover_pb = selector_from_toml(entry["remover"], f"{where} remover")
        limiter = rate_limiter_from_toml(entry["rate_limiter"], max_size, f"{where} rate_limiter")
        max_times_sampled = _int(entry, "max_times_sampled", 0, where)
    config = pb.TableConfig(
        name=name, sampler=sampler_pb, remover=remover_pb, max_size=max_size,
        rate_limiter=limiter.to_proto(), max_times_sampled=max_times_sampled,
        initial_max_length=_int(entry, "initial_max_length", 0, where),
    )
    if config.initial_max_length < 0:
        raise ConfigError(f"{where}: initial_max_length must be >= 0")
    if "signature" in entry:
        config.signature.CopyFrom(signature_from_toml(entry["signature"], f"{where} signature"))
    if "gpu_mirror" in entry:
        config.gpu_mirror.CopyFrom(gpu_mirror_from_toml(entry["gpu_mirror"], f"{where} gpu_mirror"))
    return config


def byte_size(value: Any, where: str) -> int:
    """A positive byte count: an integer, or a string such as ``"8GiB"``, ``"512 MiB"``, ``"2GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a byte size such as 8GiB, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _BYTE_SIZE.match(value)) and m.group(2).upper() in _BYTE_UNITS:
        n = int(float(m.group(1)) * _BYTE_UNITS[m.group(2).upper()])
    else:
        raise ConfigError(f"{where} must be a byte size such as 8GiB or 512MiB, got {value!r}")
    if n <= 0:
        raise ConfigError(f"{where} must be more than 0 bytes, got {value!r}")
    return n


def gpu_mirror_from_toml(value: Any, where: str) -> pb.GpuMirror:
    """``{ device = 0, bytes = "8GiB" }`` (``backend = "host"``: the host-memory stand-in, for tests)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table such as {{ device = 0, bytes = \"8GiB\" }}, got {value!r}")
    known_keys(value, _GPU_MIRROR_KEYS, where)
    if "bytes" not in value:
        raise ConfigError(f"{where}: bytes (the budget, e.g. \"8GiB\") is required")
    device = _int(value, "device", 0, where)
    if device < 0:
        raise ConfigError(f"{where}: device must be a CUDA ordinal >= 0, got {device}")
    backend = _typed(value, "backend", str, "cuda", where)
    if backend not in ("cuda", "host"):
        raise ConfigError(f"{where}: backend must be 'cuda' or 'host', got {backend!r}")
    return pb.GpuMirror(device=device, bytes=byte_size(value["bytes"], f"{where} bytes"), backend=backend)


_SIMPLE_SELECTORS = {
    "uniform": selectors.Uniform, "fifo": selectors.Fifo, "lifo": selectors.Lifo,
    "max_heap": selectors.MaxHeap, "min_heap": selectors.MinHeap,
}


def selector_from_toml(value: Any, where: str) -> pb.SelectorOptions:
    """``"uniform"`` etc., or ``{ prioritized = { priority_exponent = x } }``."""
    if isinstance(value, str):
        if value == "prioritized":
            raise ConfigError(f"{where}: prioritized needs its exponent: "
                              "{ prioritized = { priority_exponent = 0.8 } }")
        cls = _SIMPLE_SELECTORS.get(value)
        if cls is None:
            raise ConfigError(f"{where}: unknown selector {value!r}; "
                              f"known: {sorted(_SIMPLE_SELECTORS)} and prioritized")
        return cls().to_proto()
    if isinstance(value, dict) and len(value) == 1:
        (kind, options), = value.items()
        if kind == "prioritized":
            if not isinstance(options, dict) or set(options) != {"priority_exponent"}:
                raise ConfigError(f"{where}: write {{ prioritized = {{ priority_exponent = <number> }} }}")
            exponent = options["priority_exponent"]
            if isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
                raise ConfigError(f"{where}: priority_exponent must be a number, got {exponent!r}")
            try:
                return selectors.Prioritized(exponent).to_proto()
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from e
        if kind in _SIMPLE_SELECTORS and options in ({}, True):
            return _SIMPLE_SELECTORS[kind]().to_proto()
    raise ConfigError(f"{where}: expected a selector name or {{ prioritized = {{ priority_exponent = x }} }}, "
                      f"got {value!r}")


def rate_limiter_from_toml(value: Any, max_size: int, where: str) -> rate_limiters.RateLimiter:
    """A rate limiter from its TOML form (see the module docstring)."""
    if value == "queue":
        return rate_limiters.Queue(max_size)
    if value == "stack":
        return rate_limiters.Stack(max_size)
    if not (isinstance(value, dict) and len(value) == 1):
        raise ConfigError(f"{where}: expected \"queue\", \"stack\" or a one-key table "
                          f"(min_size, sample_to_insert_ratio, explicit), got {value!r}")
    (kind, options), = value.items()
    try:
        if kind == "min_size":
            if isinstance(options, dict):
                _only(options, {"min_size_to_sample"}, where)
                options = options.get("min_size_to_sample")
            return rate_limiters.MinSize(_require_int(options, f"{where} min_size"))
        if kind == "sample_to_insert_ratio":
            if not isinstance(options, dict):
                raise ConfigError(f"{where}: sample_to_insert_ratio must be a table")
            _only(options, {"samples_per_insert", "min_size_to_sample", "error_buffer"}, where, required=True)
            buffer = options["error_buffer"]
            if isinstance(buffer, list):
                if len(buffer) != 2:
                    raise ConfigError(f"{where}: error_buffer as a list must be [min_diff, max_diff]")
                buffer = (_require_number(buffer[0], where), _require_number(buffer[1], where))
            else:
                buffer = _require_number(buffer, f"{where} error_buffer")
            return rate_limiters.SampleToInsertRatio(
                _require_number(options["samples_per_insert"], f"{where} samples_per_insert"),
                _require_int(options["min_size_to_sample"], f"{where} min_size_to_sample"), buffer)
        if kind == "explicit":
            if not isinstance(options, dict):
                raise ConfigError(f"{where}: explicit must be a table")
            _only(options, {"samples_per_insert", "min_size_to_sample", "min_diff", "max_diff"}, where, required=True)
            return rate_limiters.RateLimiter(
                _require_number(options["samples_per_insert"], where),
                _require_int(options["min_size_to_sample"], where),
                _require_number(options["min_diff"], where), _require_number(options["max_diff"], where))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
    raise ConfigError(f"{where}: unknown rate limiter {kind!r}; known: min_size, sample_to_insert_ratio, explicit, "
                      f"\"queue\", \"stack\"")


class _TomlSpec:
    """A leaf of a TOML signature (a table holding dtype and shape)."""


def signature_from_toml(value: Any, where: str) -> pb.Signature:
    """Nested tables of ``{ dtype = ..., shape = [...] }`` leaves -> Signature (leaf names are their paths)."""
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: must be a non-empty table of {{ dtype, shape }} leaves")

    def build(node: dict[str, Any], path: str) -> Any:
        if "dtype" in node or "shape" in node:
            _only(node, {"dtype", "shape"}, f"{where} {path}", required=True)
            shape = node["shape"]
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                raise ConfigError(f"{where} {path}: shape must be a list of integers (-1: any), got {shape!r}")
            try:
                return specs.TensorSpec(shape, node["dtype"], name=path)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{where} {path}: {e}") from e
        out = {}
        for key, child in node.items():
            if not isinstance(child, dict):
                raise ConfigError(f"{where} {path + '/' if path else ''}{key}: expected a table, got {child!r}")
            out[key] = build(child, f"{path}/{key}" if path else key)
        return out

    return specs.signature_to_proto(build(value, ""))


# ------------------------------------------------------------------ scalars ----

def _typed(d: dict[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    value = d.get(key, default)
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: {key} must be a {kind.__name__}, got {value!r}")
    return value


def _int(d: dict[str, Any], key: str, default: int | None, where: str) -> int | None:
    value = d.get(key, default)
    if value is None:
        return None
    return _require_int(value, f"{where}: {key}")


def _require_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    return value


def _require_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    return float(value)


def known_keys(section: Mapping[str, Any] | None, known: Iterable[str], where: str) -> dict[str, Any]:
    """A copy of a TOML table (None: empty) after checking it holds only ``known`` keys.

    Raises:
      ConfigError: naming the keys that are not known.
    """
    section = dict(section or {})
    known = set(known)
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    return section


def _only(options: dict[str, Any], allowed: set[str], where: str, required: bool = False) -> None:
    known_keys(options, allowed, where)
    if required:
        missing = sorted(allowed - set(options))
        if missing:
            raise ConfigError(f"{where}: missing key(s) {missing}")
