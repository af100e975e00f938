"""DeepMind Reverb's name for gear: ``import reverb`` runs gear_client (the user opted in by installing this).

Every public name (``reverb.Client``, ``reverb.Table``...) is gear_client's, and
Reverb's modules map to gear's (``from reverb import structured_writer``,
``reverb.rate_limiters``...; gear_client.REVERB_MODULES lists them). With
TensorFlow installed, ``reverb.TrajectoryDataset``, ``reverb.TimestepDataset`` and
``reverb.PatternDataset``, and the modules ``reverb.trajectory_dataset``,
``reverb.timestep_dataset`` and ``reverb.pattern_dataset``, are Reverb's tf.data
datasets (gear_client.tf; gear_client.REVERB_TF_MODULES), as Reverb code expects.
Nothing is copied: this package only forwards, so it follows the installed gear.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import gear_client

__version__ = gear_client.__version__


def _refuse_if_installed_over_dm_reverb() -> None:
    """ImportError when these files replaced dm-reverb's (a `pip install --force` or a copy)."""
    site_dir = Path(__file__).resolve().parent.parent
    found = sorted(site_dir.glob("dm_reverb-*.dist-info"))
    if found:
        raise ImportError(
            f"gear's `reverb` alias was installed over dm-reverb in {site_dir} ({found[0].name}): both packages "
            "are broken now. `pip uninstall gear-reverb-alias dm-reverb`, then install the one you want.")


_refuse_if_installed_over_dm_reverb()


class _AliasLoader(importlib.abc.Loader):
    """Loads ``reverb.X`` as the gear module that implements it (the same module object, not a copy)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # The import system returns what sys.modules holds under the name after this call.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, rest = fullname.partition(".")
        if prefix != __name__ or not rest or "." in rest:
            return None
        module = gear_client.reverb_module(rest)
        if module is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module))


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def _tensorflow_installed() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def __getattr__(name: str) -> Any:
    if name in gear_client.REVERB_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in gear_client.TF_EXPORTS and _tensorflow_installed():  # Reverb's datasets are tf.data ones
        module, attribute = gear_client.TF_EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
    else:
        value = getattr(gear_client, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(gear_client)) | set(gear_client.REVERB_MODULES))
