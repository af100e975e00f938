"""Reverb's TensorFlow faces (needs TensorFlow): tf.data datasets, TFClient, tf.TensorSpec signatures.

Imported on first use, so ``import gear_client.tf`` works without TensorFlow and
only the names that need it fail.
"""

from __future__ import annotations

import importlib
from typing import Any

from gear_contract.specs import as_program_specs as as_program_specs  # re-exported

_EXPORTS = {
    "ReplayDataset": "gear_client.tf.datasets",
    "TrajectoryDataset": "gear_client.tf.datasets",
    "TimestepDataset": "gear_client.tf.datasets",
    "TFClient": "gear_client.tf.client",
    "to_tf_spec": "gear_client.tf.specs",
    "to_tf_signature": "gear_client.tf.specs",
}

__all__ = sorted([*_EXPORTS, "PatternDataset", "as_program_specs"])
_EXPORTS["PatternDataset"] = "gear_client.tf.pattern_dataset"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gear_client.tf' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
