"""pytest plugin: Reverb's and TF-Agents' published tests, unchanged, against gear (`make test-tf-published`).

Loaded with ``-p published_tests`` (tests/client/tf on the path). It puts
gear's ``reverb`` alias (alias/reverb, from the source tree) first on the path,
so ``import reverb`` in those files is gear; turns eager execution off where the
file's own ``__main__`` does (Reverb's graph-mode dataset tests), which pytest
never runs; and skips, by name, the tests that check what gear documents as
different (docs/REVERB_COMPAT.md), each with its reason. The files themselves are
never edited.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "alias" / "reverb"))
sys.path.insert(1, str(ROOT))
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # TF-Agents needs Keras 2
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# Test id (a substring of the node id) -> why gear differs (docs/REVERB_COMPAT.md).
SKIPS: dict[str, str] = {
    "test_session_is_closed_while_op_pending": (
        "closing a TF1 session does not cancel a get_next waiting in gear's Python-side fetch (tf.data cannot "
        "interrupt a Python generator); rate_limiter_timeout_ms bounds the wait"),
    "test_distribution_strategy": (
        "MirroredStrategy over four virtual CPUs in TF1 graph mode: gear's datasets are Python generators, which "
        "tf.data cannot place on several devices of one graph"),
}


def _main_block(path: Path) -> str:
    """The text of the file's ``if __name__ == '__main__':`` block ('' without one)."""
    text = path.read_text()
    for marker in ("if __name__ == '__main__':", 'if __name__ == "__main__":'):
        if marker in text:
            return text.split(marker, 1)[1]
    return ""


def pytest_configure(config: pytest.Config) -> None:
    files = {Path(arg.split("::")[0]) for arg in config.args}
    files = {f for f in files if f.is_file()}
    graph = {f for f in files if "disable_eager_execution()" in _main_block(f)}
    if graph and graph != files:
        raise pytest.UsageError(f"run graph-mode test files alone (their __main__ turns eager off): {sorted(graph)}")
    if graph:
        import tensorflow as tf

        tf.compat.v1.disable_eager_execution()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name, reason in SKIPS.items():
            if name in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"gear differs: {reason}"))
