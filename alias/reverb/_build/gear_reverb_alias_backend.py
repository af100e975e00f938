"""Build backend of the `reverb` alias: setuptools' own, after checking that dm-reverb is not where it goes.

The alias's `reverb` package would overwrite dm-reverb's files (both are the
package `reverb`), breaking it silently. pip runs this backend with the target
environment's interpreter, so its site-packages are known here: if dm-reverb
is installed there, the build stops with a message saying what to do.
``GEAR_REVERB_ALIAS_FORCE=1`` skips the check (a ``--target`` elsewhere, say).
"""

from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path

from setuptools import build_meta as _setuptools

__all__ = ["build_wheel", "build_sdist", "build_editable", "get_requires_for_build_wheel",
           "get_requires_for_build_sdist", "get_requires_for_build_editable", "prepare_metadata_for_build_wheel",
           "prepare_metadata_for_build_editable", "dm_reverb_installations"]


def dm_reverb_installations(site_dirs: list[str] | None = None) -> list[Path]:
    """The dm-reverb installations (their .dist-info) in the target environment's site directories."""
    if site_dirs is None:
        site_dirs = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
        if site.ENABLE_USER_SITE:
            site_dirs.append(site.getusersitepackages())
    found = []
    for directory in dict.fromkeys(site_dirs):
        found.extend(sorted(Path(directory).glob("dm_reverb-*.dist-info")))
    return found


def _refuse_over_dm_reverb() -> None:
    if os.environ.get("GEAR_REVERB_ALIAS_FORCE") == "1":
        return
    found = dm_reverb_installations()
    if found:
        where = ", ".join(str(p.parent) for p in found)
        raise SystemExit(
            f"gear-reverb-alias refuses to install over dm-reverb (found {', '.join(p.name for p in found)} in "
            f"{where}): both are the package `reverb`, and installing this one would overwrite DeepMind Reverb's "
            "files. Use another environment, or `pip uninstall dm-reverb` first; GEAR_REVERB_ALIAS_FORCE=1 skips "
            "this check (for `pip install --target` into a directory without dm-reverb).")


def get_requires_for_build_wheel(config_settings=None):
    _refuse_over_dm_reverb()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _refuse_over_dm_reverb()
    return _setuptools.get_requires_for_build_editable(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _setuptools.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _refuse_over_dm_reverb()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _refuse_over_dm_reverb()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _refuse_over_dm_reverb()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _refuse_over_dm_reverb()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _setuptools.build_sdist(sdist_directory, config_settings)
