"""Checkpoints: a daemon's tables written atomically, verified when read back, rotated, restored.

``Checkpointer`` names, lists, keeps and chooses; ``write`` and ``read`` do one
checkpoint each; ``format`` and ``files`` are the on-disk format
(docs/CHECKPOINT_FORMAT.md).
"""

from gear_server.checkpoint.checkpointer import Checkpointer
from gear_server.checkpoint.format import CheckpointError, TableState
from gear_server.checkpoint.settings import CheckpointSettings

__all__ = ["CheckpointError", "CheckpointSettings", "Checkpointer", "TableState"]
