"""The daemons' configuration under Ray: one TOML document for every shard, made node-specific on each node.

The tables are defined once (the ``gear-server`` TOML schema, deploy/gear-server.example.toml) and checked on
the driver with gear's own loader before any actor starts. On each node the daemon actor sets what differs per
node: the port it binds (kept across restarts), the checkpoint folder, and the shared-memory folder when
``GEAR_RAY_SHM_DIR`` names one. Nothing here imports Ray.
"""

from __future__ import annotations

import copy
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gear_server.config import ConfigError, parse_config

__all__ = ["ENV_SHM_DIR", "ConfigError", "config_document", "node_document", "render_toml", "select_nodes"]

# A node's shared-memory folder for its daemon (several simulated Ray nodes on one machine need one each).
ENV_SHM_DIR = "GEAR_RAY_SHM_DIR"


def config_document(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The configuration as a TOML document (a dict), checked by gear's loader.

    Args:
      config: a path to a TOML file, TOML text, or the parsed document.

    Raises:
      ConfigError: the file cannot be read, or the configuration is invalid (the message names the key).
    """
    if isinstance(config, Mapping):
        document = copy.deepcopy(dict(config))
    elif isinstance(config, Path) or (isinstance(config, str) and "\n" not in config and config.endswith(".toml")):
        try:
            text = Path(config).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {config}: {exc.strerror or exc}") from exc
        document = _loads(text, str(config))
    elif isinstance(config, str):
        document = _loads(config, "the config text")
    else:
        raise TypeError(f"config must be a TOML path, TOML text or a dict, got {type(config).__name__}")
    parse_config(copy.deepcopy(document))
    return document


def _loads(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {exc}") from exc


def node_document(document: Mapping[str, Any], *, port: int, checkpoint_dir: str,
                  shm_dir: str | None = None) -> dict[str, Any]:
    """One node's document: its port and checkpoint folder (and shm folder), the rest as given.

    The checkpoint section keeps the operator's interval and count; a daemon under Ray always restores
    at start and writes a final checkpoint when it is stopped, since that is how a restarted actor rejoins
    with its items.
    """
    out = copy.deepcopy(dict(document))
    out["port"] = int(port)
    if shm_dir:
        out["shm_dir"] = str(shm_dir)
    checkpoint = dict(out.get("checkpoint") or {})
    checkpoint.update(dir=str(checkpoint_dir), restore=True, on_stop=True)
    out["checkpoint"] = checkpoint
    parse_config(copy.deepcopy(out))
    return out


def select_nodes(nodes: Iterable[Mapping[str, Any]], *, node_ids: Iterable[str] | None = None,
                 resource: str | None = None, labels: Mapping[str, str] | None = None) -> list[str]:
    """The ids of the alive nodes (``ray.nodes()`` entries) that get a daemon, in a stable order.

    Every node with GPUs by default; else the nodes named, those with ``resource``, or those whose labels
    include ``labels``. ValueError names what matched nothing.
    """
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    if node_ids is not None:
        wanted = list(dict.fromkeys(node_ids))
        known = {n["NodeID"] for n in alive}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise ValueError(f"no alive Ray node with id(s) {missing}")
        return wanted
    if resource is not None:
        chosen = [n for n in alive if n.get("Resources", {}).get(resource, 0) > 0]
        what = f"resource {resource!r}"
    elif labels:
        chosen = [n for n in alive if all((n.get("Labels") or {}).get(k) == v for k, v in labels.items())]
        what = f"labels {dict(labels)}"
    else:
        chosen = [n for n in alive if n.get("Resources", {}).get("GPU", 0) > 0]
        what = "GPUs (name the nodes with node_ids=, resource= or labels=)"
    if not chosen:
        raise ValueError(f"no alive Ray node has {what}")
    return sorted(n["NodeID"] for n in chosen)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def render_toml(document: Mapping[str, Any]) -> str:
    """TOML text of a document with gear's shape: top-level values, ``[section]`` tables, ``[[tables]]`` arrays;
    anything deeper as inline tables and arrays. ``tomllib.loads(render_toml(d)) == d``."""
    lines: list[str] = []
    sections: list[tuple[str, Mapping[str, Any]]] = []
    arrays: list[tuple[str, list[Mapping[str, Any]]]] = []
    for key, value in document.items():
        if isinstance(value, Mapping):
            sections.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            arrays.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, entries in arrays:
        for entry in entries:
            lines += ["", f"[[{_key(key)}]]"] + [f"{_key(k)} = {_value(v)}" for k, v in entry.items()]
    for key, section in sections:
        lines += ["", f"[{_key(key)}]"] + [f"{_key(k)} = {_value(v)}" for k, v in section.items()]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _string(key)


def _string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(c if c >= " " and c != "\x7f" else f"\\u{ord(c):04x}" for c in escaped)
    return f'"{escaped}"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {type(value).__name__} value {value!r} as TOML")
