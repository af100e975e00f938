"""NIXL, imported lazily: whether it is here, agents with gear's settings, descriptor arrays.

NIXL (``gear[nixl]``: the ``nixl-cu12`` wheel, or ``nixl-cu13``) is optional; gear
without it never imports it. Both the daemon (which registers its table segments
with an agent) and the learner (whose agent READs them) go through this module.
Descriptors are plain ``(address, length, device id)`` rows (an ``N x 3`` uint64
array); torch is never imported.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from typing import Any

import numpy as np

# The distributions that provide NIXL's Python API, tried in this order.
MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
BACKEND = "UCX"
DRAM = "DRAM"
VRAM = "VRAM"

_module: Any = None
_reason: str | None = None


class NixlUnavailableError(RuntimeError):
    """NIXL cannot be used in this process (not installed, or no UCX backend)."""


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed or did not complete in time."""


def _load() -> tuple[Any, str | None]:
    global _module, _reason
    if _module is not None or _reason is not None:
        return _module, _reason
    broken = []  # installed but not importable (a missing shared library, a wrong CUDA build)
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                broken.append(f"{name}: {exc}")
            continue
        except ImportError as exc:
            broken.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent's start at INFO on stdout
            logging.getLogger("nixl").setLevel(logging.WARNING)
        _module = module
        return _module, None
    _reason = (f"NIXL cannot be imported ({'; '.join(broken)})" if broken
               else "NIXL not installed (pip install 'gear[nixl]')")
    return None, _reason


def unavailable_reason() -> str | None:
    """Why NIXL cannot be used here (None: it can)."""
    return _load()[1]


def new_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, its progress thread and strict locking, named ``gear-<role>-<random>``.

    Raises NixlUnavailableError without NIXL or when the UCX backend does not come up.
    """
    module, reason = _load()
    if module is None:
        raise NixlUnavailableError(reason)
    name = f"gear-{role}-{uuid.uuid4().hex[:12]}"
    # Strict locking: the daemon registers segments from its pool threads while UCX's progress thread
    # serves READs (NIXL's default without a listener thread assumes one thread).
    config = module.nixl_agent_config(backends=[BACKEND], sync_mode=module.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    try:
        agent = module.nixl_agent(name, config)
    except Exception as exc:  # noqa: BLE001 - the binding raises its own error types
        raise NixlUnavailableError(f"NIXL agent could not start: {exc}") from exc
    if BACKEND not in agent.backends:
        raise NixlUnavailableError(f"NIXL has no {BACKEND} backend here (plugins: {agent.plugin_list})")
    return agent


def descriptors(addresses: np.ndarray, lengths: np.ndarray, device_id: int = 0) -> np.ndarray:
    """An ``N x 3`` uint64 descriptor array: (address, length, device id) per row."""
    out = np.empty((len(addresses), 3), dtype=np.uint64)
    out[:, 0] = addresses
    out[:, 1] = lengths
    out[:, 2] = device_id
    return out
