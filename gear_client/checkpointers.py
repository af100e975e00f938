"""Checkpointers (`reverb.checkpointers`): where a Server keeps its checkpoints.

A checkpointer only names a directory; the daemon's checkpoint machinery
(gear_server/checkpoint/checkpointer.py) writes there on ``Client.checkpoint()`` and restores
the newest complete checkpoint from there at start.
"""

from __future__ import annotations

import abc
import os
import tempfile

from gear_contract._proto import replay_pb2 as pb

__all__ = ["CheckpointerBase", "DefaultCheckpointer", "RecordIOCheckpointer", "TempDirCheckpointer",
           "default_checkpointer"]


class CheckpointerBase(abc.ABC):
    """Base of the checkpointer option objects."""

    @abc.abstractmethod
    def configure(self, config: pb.ServerConfig) -> None:
        """Write this checkpointer's settings into a daemon's ServerConfig."""


class DefaultCheckpointer(CheckpointerBase):
    """Stores checkpoints under ``path``; restores the newest one found there at start."""

    def __init__(self, path: str, group: str = "", fallback_checkpoint_path: str | None = None):
        """A checkpointer writing under ``path``.

        Args:
          path: the directory checkpoints are written to and restored from (created when needed).
          group: accepted for Reverb's API and ignored.
          fallback_checkpoint_path: one checkpoint to load when ``path`` holds none (to start from another
            experiment's data).

        Raises:
          ValueError: ``path`` is empty.
        """
        if not path:
            raise ValueError("path must name a directory")
        self.path = os.fspath(path)
        self.group = group
        self.fallback_checkpoint_path = fallback_checkpoint_path

    def configure(self, config: pb.ServerConfig) -> None:
        config.checkpoint_dir = os.path.abspath(self.path)
        if self.fallback_checkpoint_path and "fallback_checkpoint_path" in pb.ServerConfig.DESCRIPTOR.fields_by_name:
            config.fallback_checkpoint_path = os.path.abspath(self.fallback_checkpoint_path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r})"


# Reverb's name for its on-disk format; ours is the same class.
RecordIOCheckpointer = DefaultCheckpointer


class TempDirCheckpointer(DefaultCheckpointer):
    """Stores checkpoints in a fresh temporary directory."""

    def __init__(self):
        """A checkpointer writing into a new directory under the system's temporary directory."""
        super().__init__(tempfile.mkdtemp(prefix="gear-checkpoints-"))


def default_checkpointer(group: str | None = None) -> CheckpointerBase:
    """The checkpointer a Server uses when given none (a temporary directory, as in Reverb).

    Args:
      group: accepted for Reverb's API and ignored.
    """
    del group
    return TempDirCheckpointer()
