"""Checkpoints through Reverb's API: Server(checkpointer=...), Client.checkpoint(), fallback_checkpoint_path."""

from __future__ import annotations

import numpy as np

import gear_client as reverb


def _tables():
    return [reverb.Table.queue("queue", 100),
            reverb.Table("prio", reverb.selectors.Prioritized(1.0), reverb.selectors.Fifo(), 100,
                         reverb.rate_limiters.MinSize(1))]


def test_checkpoint_path_and_fallback_checkpoint_path(tmp_path):
    first = reverb.Server(_tables(), checkpointer=reverb.checkpointers.DefaultCheckpointer(str(tmp_path / "a")))
    try:
        client = first.localhost_client()
        for v in range(4):
            client.insert({"obs": np.full(2, v, np.float32)}, priorities={"queue": 1.0, "prio": v + 1.0})
        path = client.checkpoint()
        assert path.startswith(str(tmp_path / "a")) and (tmp_path / "a" / path).is_dir()
    finally:
        first.stop()

    # Reverb's fallback: an empty checkpoint dir of its own, another run's checkpoints as the fallback.
    checkpointer = reverb.checkpointers.DefaultCheckpointer(str(tmp_path / "b"),
                                                            fallback_checkpoint_path=path)
    second = reverb.Server(_tables(), checkpointer=checkpointer)
    try:
        client = second.localhost_client()
        assert client.server_info(timeout=30)["queue"].current_size == 4
        values = [int(s.data[0].reshape(-1)[0]) for s in client.sample("queue", 4, emit_timesteps=False)]
        assert values == [0, 1, 2, 3]
        assert client.checkpoint().startswith(str(tmp_path / "b"))  # new checkpoints go to its own dir
    finally:
        second.stop()
