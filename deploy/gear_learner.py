#!/usr/bin/env python3
"""A small actor-and-learner run against a deployed gear: the Kubernetes Job and the Slurm script run it.

It writes ``--episodes`` trajectories of random steps into ``--table`` (observation, action, reward:
the signature of deploy/kubernetes/configmap.yaml and deploy/slurm/gear-shard.toml), then pulls
``--batches`` batches of ``--batch-size`` items over every shard with a TrajectoryDataset, checks
their shapes, and prints one line per figure. Exit 0 when every batch came, 1 otherwise.

    python deploy/gear_learner.py --shards shards:gear.gear.svc.cluster.local:8000
    GEAR_SHARDS=node1:8000,node2:8000 python deploy/gear_learner.py

The token comes from GEAR_TOKEN or GEAR_TOKEN_FILE, as for every gear client.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import gear_client as reverb


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default=os.environ.get("GEAR_SHARDS"),
                        help="the shard list: 'a:8000,b:8000' or 'shards:NAME:PORT' (default $GEAR_SHARDS)")
    parser.add_argument("--table", default="replay")
    parser.add_argument("--episodes", type=int, default=64, help="trajectories written before learning")
    parser.add_argument("--steps", type=int, default=16, help="steps per trajectory")
    parser.add_argument("--obs-dim", type=int, default=1024, help="the observation's width in the table signature")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--device", default=None, help="'cuda' to gather into GPU memory (needs cupy)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="give up on a batch after this long")
    args = parser.parse_args(argv)
    if not args.shards:
        parser.error("give --shards or set GEAR_SHARDS")
    for name in ("episodes", "steps", "obs_dim", "batch_size", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def shard_spec(text: str) -> str | list[str]:
    """A 'shards:' name as it is; 'a,b' as a list (one address stays a one-shard list)."""
    if text.startswith("shards:"):
        return text
    return [part.strip() for part in text.split(",") if part.strip()]


def write(client, args: argparse.Namespace) -> None:
    rng = np.random.default_rng()
    with client.trajectory_writer(args.steps) as writer:
        for _ in range(args.episodes):
            for _ in range(args.steps):
                writer.append({"observation": rng.random(args.obs_dim, dtype=np.float32),
                               "action": np.int64(rng.integers(0, 16)),
                               "reward": np.float32(rng.random())})
            trajectory = {k: writer.history[k][-args.steps:] for k in ("observation", "action", "reward")}
            writer.create_item(args.table, priority=float(rng.random()) + 0.1, trajectory=trajectory)
            writer.end_episode()
        writer.flush()


def learn(spec, args: argparse.Namespace) -> tuple[int, float, str]:
    """Pull the batches; (items, seconds, plane)."""
    items = 0
    dataset = reverb.TrajectoryDataset(spec, args.table, args.batch_size, device=args.device,
                                       rate_limiter_timeout_ms=int(args.timeout_s * 1000))
    with dataset:
        start = time.perf_counter()
        for i, sample in enumerate(dataset):
            observation = sample.data["observation"]
            if tuple(observation.shape) != (args.batch_size, args.steps, args.obs_dim):
                raise SystemExit(f"batch {i}: observation shape {tuple(observation.shape)}, expected "
                                 f"{(args.batch_size, args.steps, args.obs_dim)}")
            items += len(sample.info.key)
            if i + 1 == args.batches:
                break
        seconds = time.perf_counter() - start
        return items, seconds, dataset.plane or ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = shard_spec(args.shards)
    client = reverb.Client(spec)
    try:
        for shard in client.shards():
            print(f"shard {shard.index}: {shard.address} host {shard.host_id[:12]} {'up' if shard.up else 'down'}")
        write(client, args)
        info = client.server_info()[args.table]
        print(f"table {args.table}: {info.current_size} items over {len(info.shards)} shard(s)")
    finally:
        client.close()
    items, seconds, plane = learn(spec, args)
    item_bytes = args.steps * (args.obs_dim * 4 + 8 + 4)
    print(f"learner: {items} items in {seconds:.3f} s over {plane}: {items / seconds:.0f} items/s, "
          f"{items * item_bytes / seconds / 1e9:.3f} GB/s")
    if items != args.batches * args.batch_size:
        print(f"learner: expected {args.batches * args.batch_size} items", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
