"""Build backend of the `reverb` alias: setuptools' own, after checking that dm-reverb is not where it goes.

The alias's `reverb` package would overwrite dm-reverb's files (both are the
package `reverb`), breaking it silently. pip runs this backend with the target
environment's interpreter, so its site-packages are known here: if dm-reverb
is installed there, the build stops with a message saying what to do.
``GEAR_REVERB_ALIAS_FORCE=1`` skips the check (a ``--target`` elsewhere, say).

setuptools builds in the source folder (``build/``, ``*.egg-info``); every
hook here removes what it made there, so ``pip install ./alias/reverb`` leaves
the checkout as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import site
import sysconfig
from collections.abc import Iterator
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


_SOURCE = Path(__file__).resolve().parents[1]  # alias/reverb: where setuptools writes its build files


def _build_leftovers() -> set[Path]:
    return {p for p in (_SOURCE / "build", *_SOURCE.glob("*.egg-info")) if p.exists()}


@contextlib.contextmanager
def _leaves_no_build_files() -> Iterator[None]:
    """Remove the build files a setuptools hook made in the source folder (those there before stay)."""
    before = _build_leftovers()
    try:
        yield
    finally:
        for path in _build_leftovers() - before:
            shutil.rmtree(path, ignore_errors=True)


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
    with _leaves_no_build_files():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _refuse_over_dm_reverb()
    with _leaves_no_build_files():
        return _setuptools.get_requires_for_build_editable(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    with _leaves_no_build_files():
        return _setuptools.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _refuse_over_dm_reverb()
    with _leaves_no_build_files():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _refuse_over_dm_reverb()
    with _leaves_no_build_files():
        return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _refuse_over_dm_reverb()
    with _leaves_no_build_files():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _refuse_over_dm_reverb()
    with _leaves_no_build_files():
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    with _leaves_no_build_files():
        return _setuptools.build_sdist(sdist_directory, config_settings)
