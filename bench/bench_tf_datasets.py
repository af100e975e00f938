"""TensorFlow learners: Reverb's tf.data TrajectoryDataset on gear against gear's own Python dataset.

One daemon (reverb.Server), a uniform table of ``items`` trajectories of
``steps`` x {obs: float32[obs], action: int64, reward: float32}. Each learner
pulls ``batches`` batches of ``batch`` items: the Python dataset
(``gear_client.TrajectoryDataset(batch_size=batch)``) and the tf.data one
(``reverb.TrajectoryDataset.from_table_signature(...).batch(batch)``), the way
Acme's ``make_reverb_dataset`` builds it. Prints GB/s of item bytes and the
ratio; the goal is tf.data at >= 0.5x the Python dataset (the tf.data path adds
one ``from_generator`` element per item and the batching copy).

    make test-tf   # once, for .venv-tf
    .venv-tf/bin/python bench/bench_tf_datasets.py [--items 512] [--steps 64] [--obs 1024] [--batch 32]
                                                  [--batches 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "alias" / "reverb"), str(ROOT)]

GOAL_RATIO = 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--obs", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args()

    import reverb
    import tensorflow as tf

    import gear_client

    signature = {"obs": tf.TensorSpec([args.steps, args.obs], tf.float32),
                 "action": tf.TensorSpec([args.steps], tf.int64), "reward": tf.TensorSpec([args.steps], tf.float32)}
    server = reverb.Server([reverb.Table("replay", reverb.selectors.Uniform(), reverb.selectors.Fifo(),
                                         args.items, reverb.rate_limiters.MinSize(1), signature=signature)])
    address = f"localhost:{server.port}"
    item_bytes = args.steps * (args.obs * 4 + 8 + 4)
    try:
        with reverb.Client(address).trajectory_writer(num_keep_alive_refs=args.steps) as writer:
            for i in range(args.items):
                for t in range(args.steps):
                    writer.append({"obs": np.full(args.obs, t, np.float32), "action": np.int64(t),
                                   "reward": np.float32(i)})
                writer.create_item("replay", 1.0, {k: writer.history[k][-args.steps:] for k in signature})
        gb = args.batches * args.batch * item_bytes / 1e9

        with gear_client.TrajectoryDataset(address, "replay", batch_size=args.batch) as python_dataset:
            batches = iter(python_dataset)
            next(batches)  # session and first batch outside the clock
            start = time.perf_counter()
            for _ in range(args.batches):
                assert next(batches).data["obs"].shape == (args.batch, args.steps, args.obs)
            python_gbps = gb / (time.perf_counter() - start)

        dataset = reverb.TrajectoryDataset.from_table_signature(address, "replay", max_in_flight_samples_per_worker=
                                                                2 * args.batch).batch(args.batch).prefetch(2)
        batches = iter(dataset)
        next(batches)
        start = time.perf_counter()
        for _ in range(args.batches):
            assert next(batches).data["obs"].shape == (args.batch, args.steps, args.obs)
        tf_gbps = gb / (time.perf_counter() - start)
        del batches
    finally:
        server.stop()

    ratio = tf_gbps / python_gbps
    print(f"items of {item_bytes / 1024:.0f} KiB, batches of {args.batch}, {args.batches} batches "
          f"(tensorflow {tf.__version__})")
    print(f"python dataset (gear_client.TrajectoryDataset): {python_gbps:6.2f} GB/s")
    print(f"tf.data dataset (reverb.TrajectoryDataset):     {tf_gbps:6.2f} GB/s  "
          f"= {ratio:.2f}x  goal >= {GOAL_RATIO}x: {'met' if ratio >= GOAL_RATIO else 'MISSED'}")


if __name__ == "__main__":
    main()
