"""The ``[checkpoint]`` section: where checkpoints live, how often, how many are kept, restore at start."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gear_contract._proto import replay_pb2 as pb
from gear_server.config import known_keys


@dataclass(frozen=True)
class CheckpointSettings:
    """The ``[checkpoint]`` section."""

    dir: str | None = None           # where checkpoints live (None: the ServerConfig's checkpoint_dir)
    interval_s: float = 0.0          # periodic checkpoints every this many seconds (0: off)
    keep: int = 3                    # complete checkpoints kept; older ones are deleted
    on_stop: bool = True             # write a final checkpoint on SIGTERM / stop
    restore: bool = True             # restore the newest good checkpoint at start
    fallback_path: str | None = None  # one checkpoint to restore when `dir` holds none

    @classmethod
    def from_toml(cls, section: Mapping[str, Any] | None) -> CheckpointSettings:
        section = known_keys(section, cls.__dataclass_fields__, "[checkpoint]")
        for key in ("dir", "fallback_path"):
            if key in section and (not isinstance(section[key], str) or not section[key]):
                raise ValueError(f"[checkpoint] {key} must be a non-empty path, got {section[key]!r}")
        interval = section.get("interval_s", 0.0)
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
            raise ValueError(f"[checkpoint] interval_s must be a number >= 0, got {interval!r}")
        keep = section.get("keep", cls.keep)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"[checkpoint] keep must be an integer >= 1, got {keep!r}")
        for key in ("on_stop", "restore"):
            if key in section and not isinstance(section[key], bool):
                raise ValueError(f"[checkpoint] {key} must be true or false, got {section[key]!r}")
        return cls(dir=section.get("dir"), interval_s=float(interval), keep=keep,
                   on_stop=section.get("on_stop", True), restore=section.get("restore", True),
                   fallback_path=section.get("fallback_path"))

    @classmethod
    def effective(cls, settings: CheckpointSettings | None, server: pb.ServerConfig) -> CheckpointSettings:
        """The section merged with what the ServerConfig says (the Python Server sets checkpoint_dir)."""
        settings = settings or cls()
        updates: dict[str, Any] = {}
        if settings.dir is None and server.checkpoint_dir:
            updates["dir"] = server.checkpoint_dir
        fallback = getattr(server, "fallback_checkpoint_path", "")
        if settings.fallback_path is None and fallback:
            updates["fallback_path"] = fallback
        return cls(**{**settings.__dict__, **updates}) if updates else settings
