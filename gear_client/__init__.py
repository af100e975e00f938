"""gear client: `import gear_client as reverb` for code written against Reverb.

The public names are Reverb's (see docs/REVERB_COMPAT.md). They are imported
on first use, so ``import gear_client`` stays light and never fails because an
optional part (datasets, structured writer) is missing from a build.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "Server": ("gear_client.server", "Server"),
    "Table": ("gear_client.server", "Table"),
    "TableInfo": ("gear_client.table_info", "TableInfo"),
    "Client": ("gear_client.client", "Client"),
    "Writer": ("gear_client.writers.legacy_writer", "Writer"),
    "TrajectoryWriter": ("gear_client.writers.trajectory_writer", "TrajectoryWriter"),
    "TrajectoryColumn": ("gear_client.writers.trajectory_writer", "TrajectoryColumn"),
    "ReplaySample": ("gear_client.replay_sample", "ReplaySample"),
    "SampleInfo": ("gear_client.replay_sample", "SampleInfo"),
    "TrajectoryDataset": ("gear_client.datasets", "TrajectoryDataset"),
    "TimestepDataset": ("gear_client.datasets", "TimestepDataset"),
    "ReplayDataset": ("gear_client.tf.datasets", "ReplayDataset"),
    "TFClient": ("gear_client.tf.client", "TFClient"),
    "tf_datasets": ("gear_client.tf.datasets", None),
    "PatternDataset": ("gear_client.tf.pattern_dataset", "PatternDataset"),
    "ReverbError": ("gear_client.errors", "ReverbError"),
    "DeadlineExceededError": ("gear_client.errors", "DeadlineExceededError"),
    "selectors": ("gear_contract.selectors", None),
    "item_selectors": ("gear_contract.selectors", None),
    "rate_limiters": ("gear_contract.rate_limiters", None),
    "specs": ("gear_contract.specs", None),
    "structured": ("gear_client.writers.structured_config", None),
    "structured_writer": ("gear_client.writers.structured_writer", None),
    "checkpointers": ("gear_client.checkpointers", None),
    "errors": ("gear_client.errors", None),
}

# Modules that need an optional dependency (module -> the dependency's import name). Without it their
# names are absent, as any missing attribute: hasattr() is False, `from gear_client import *` skips them.
_OPTIONAL_DEPENDENCIES: dict[str, str] = {
    "gear_client.tf.datasets": "tensorflow",
    "gear_client.tf.client": "tensorflow",
    "gear_client.tf.pattern_dataset": "tensorflow",
}


def _dependency_missing(module_name: str) -> str | None:
    """The optional dependency ``module_name`` needs and this environment lacks, if any."""
    dependency = _OPTIONAL_DEPENDENCIES.get(module_name)
    if dependency is not None and importlib.util.find_spec(dependency) is None:
        return dependency
    return None


__all__ = sorted(name for name, (module_name, _) in _EXPORTS.items()
                 if name != "item_selectors" and _dependency_missing(module_name) is None)

# Reverb's module names -> the module of gear that implements each: the `reverb` alias distribution
# (alias/reverb) makes `from reverb import structured_writer`, `import reverb.rate_limiters`... work.
REVERB_MODULES: dict[str, str] = {
    "client": "gear_client.client",
    "server": "gear_client.server",
    "errors": "gear_client.errors",
    "replay_sample": "gear_client.replay_sample",
    "trajectory_writer": "gear_client.writers.trajectory_writer",
    "structured_writer": "gear_client.writers.structured_writer",
    "checkpointers": "gear_client.checkpointers",
    "item_selectors": "gear_contract.selectors",
    "selectors": "gear_contract.selectors",
    "rate_limiters": "gear_contract.rate_limiters",
    "specs": "gear_contract.specs",
    "trajectory_dataset": "gear_client.datasets",
    "timestep_dataset": "gear_client.datasets",
    "tf_client": "gear_client.tf.client",
    "dataset": "gear_client.tf.datasets",
    "pattern_dataset": "gear_client.tf.pattern_dataset",
}

# Reverb's dataset modules are TensorFlow ones: where TensorFlow is installed, `from reverb import
# trajectory_dataset` (the alias) gets these, whose classes are Reverb's tf.data datasets with Reverb's
# signatures; without it REVERB_MODULES' Python iterators (whose errors name these modules).
REVERB_TF_MODULES: dict[str, str] = {
    "trajectory_dataset": "gear_client.tf.datasets",
    "timestep_dataset": "gear_client.tf.datasets",
    "pattern_dataset": "gear_client.tf.pattern_dataset",
}


def reverb_module(name: str) -> str | None:
    """The gear module that implements Reverb's module ``name`` (its tf.data one where TensorFlow is installed)."""
    if name in REVERB_TF_MODULES and importlib.util.find_spec("tensorflow") is not None:
        return REVERB_TF_MODULES[name]
    return REVERB_MODULES.get(name)

# With TensorFlow installed, code that says `import reverb` (the alias) gets Reverb's tf.data datasets
# under these names; `import gear_client as reverb` keeps the Python iterators (the tf.data ones are
# ``reverb.tf_datasets.TrajectoryDataset`` etc. there).
TF_EXPORTS: dict[str, tuple[str, str]] = {
    "TrajectoryDataset": ("gear_client.tf.datasets", "TrajectoryDataset"),
    "TimestepDataset": ("gear_client.tf.datasets", "TimestepDataset"),
    "PatternDataset": ("gear_client.tf.pattern_dataset", "PatternDataset"),
}


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'gear_client' has no attribute {name!r}")
    module_name, attribute = target
    dependency = _dependency_missing(module_name)
    if dependency is not None:
        raise AttributeError(f"gear_client.{name} needs {dependency}, which is not installed (gear itself does not: "
                             f"see docs/REVERB_COMPAT.md)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name != module_name:
            raise
        raise AttributeError(f"gear_client.{name} is not available in this build ({module_name} is missing)") from e
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
