"""`make demo`: actors and a learner around one gear daemon, on this machine.

What runs:
  * a daemon (``reverb.Server``; gear runs it as a child process) with one
    Prioritized(0.6) table of 16-step trajectories;
  * several actor processes (multiprocessing, spawn), each playing episodes of a
    toy environment and writing overlapping 16-step trajectories with a
    TrajectoryWriter, exactly as Reverb actors do;
  * a learner (this process) sampling batches (through TrajectoryDataset, which
    negotiates the best data plane: shared memory on one host), computing a
    stand-in TD error and sending the new priorities back with mutate_priorities.

It prints progress every second and the insert and sample throughput at the
end, then stops everything and exits 0 (about 30 s; ``--seconds`` changes it).
The code is Reverb code: only the import differs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time

import numpy as np

import gear_client as reverb

TABLE = "replay"
SEQUENCE = 16          # steps per trajectory item
PERIOD = 4             # a new item every PERIOD steps (items overlap)
EPISODE_STEPS = 200
OBS_DIM = 512          # float32 observation: 2 KiB a step
STEP_BYTES = OBS_DIM * 4 + 8 + 4
ITEM_BYTES = SEQUENCE * STEP_BYTES
BATCH = 64


def actor(address: str, actor_id: int, stop, items_written, steps_written) -> None:
    """Play episodes of a random-walk environment and write trajectories until told to stop."""
    client = reverb.Client(address)
    rng = np.random.default_rng(actor_id)
    with client.trajectory_writer(num_keep_alive_refs=SEQUENCE) as writer:
        while not stop.is_set():
            obs = rng.standard_normal(OBS_DIM, dtype=np.float32)
            for t in range(EPISODE_STEPS):
                action = np.int64(rng.integers(0, 4))
                reward = np.float32(np.tanh(obs[:8].sum()))
                writer.append({"observation": obs, "action": action, "reward": reward})
                obs = obs + rng.standard_normal(OBS_DIM, dtype=np.float32) * 0.1
                if writer.episode_steps >= SEQUENCE and t % PERIOD == 0:
                    h = writer.history
                    writer.create_item(TABLE, priority=1.0, trajectory={
                        "observation": h["observation"][-SEQUENCE:],
                        "action": h["action"][-SEQUENCE:],
                        "reward": h["reward"][-SEQUENCE:],
                    })
                    with items_written.get_lock():
                        items_written.value += 1
                if stop.is_set():
                    break
            with steps_written.get_lock():
                steps_written.value += t + 1
            writer.end_episode(timeout_ms=30_000)


class Learner:
    """Samples batches, computes a stand-in TD error, writes priorities back."""

    def __init__(self, address: str):
        self.client = reverb.Client(address)
        self.address = address
        self.dataset = None
        self.items_sampled = 0
        self.updates = 0
        self.batches = 0
        try:
            self.dataset = reverb.TrajectoryDataset(address, TABLE, BATCH)
            self.plane = "TrajectoryDataset"
        except (AttributeError, ImportError):
            self.plane = "client.sample"

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys [B], rewards [B, SEQUENCE]) of one batch."""
        if self.dataset is not None:
            sample = next(self.dataset)
            return np.asarray(sample.info.key), np.asarray(sample.data["reward"])
        samples = list(self.client.sample(TABLE, BATCH, emit_timesteps=False))
        keys = np.array([s.info.key for s in samples], dtype=np.uint64)
        rewards = np.stack([s.data[2] for s in samples])  # leaves in sorted order: action, observation, reward
        return keys, rewards

    def step(self) -> None:
        keys, rewards = self.next_batch()
        td_error = np.abs(rewards - rewards.mean(axis=1, keepdims=True)).mean(axis=1) + 1e-3
        self.client.mutate_priorities(TABLE, updates={int(k): float(p) for k, p in zip(keys, td_error, strict=True)})
        self.items_sampled += len(keys)
        self.updates += len(keys)
        self.batches += 1

    def close(self) -> None:
        if self.dataset is not None:
            self.dataset.close()


def report_progress(address: str, learner: Learner, start: float, done) -> None:
    """Print the table's state and the learner's counters every second."""
    client = reverb.Client(address)
    while not done.wait(1.0):
        info = client.server_info(timeout=10)[TABLE]
        print(f"  t={time.monotonic() - start:5.1f}s  table size {info.current_size:6d}  "
              f"inserted {info.rate_limiter_info.insert_stats.completed:7d}  "
              f"sampled {learner.items_sampled:8d}  priority updates {learner.updates:8d}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gear demo: actors, a daemon and a learner on localhost")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long actors and learner run")
    parser.add_argument("--actors", type=int, default=3)
    args = parser.parse_args(argv)

    table = reverb.Table(TABLE, sampler=reverb.selectors.Prioritized(0.6), remover=reverb.selectors.Fifo(),
                         max_size=20_000, rate_limiter=reverb.rate_limiters.MinSize(2 * BATCH))
    server = reverb.Server([table], port=None)
    address = f"localhost:{server.port}"
    print(f"daemon serving table '{TABLE}' on {address}; {args.actors} actors, learner batch {BATCH}, "
          f"items of {SEQUENCE} steps ({ITEM_BYTES / 1024:.1f} KiB)", flush=True)

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    items_written, steps_written = ctx.Value("q", 0), ctx.Value("q", 0)
    actors = [ctx.Process(target=actor, args=(address, i, stop, items_written, steps_written), daemon=True)
              for i in range(args.actors)]
    for p in actors:
        p.start()

    learner = Learner(address)
    plane = learner.plane
    exit_code = 0
    start = time.monotonic()
    done = threading.Event()
    reporter = threading.Thread(target=report_progress, args=(address, learner, start, done), daemon=True)
    reporter.start()
    try:
        while time.monotonic() - start < args.seconds:
            if not any(p.is_alive() for p in actors):
                print("every actor died", file=sys.stderr)
                exit_code = 1
                break
            learner.step()
            if learner.dataset is not None and plane == "TrajectoryDataset":
                plane = f"TrajectoryDataset ({learner.dataset.plane} plane)"
    finally:
        elapsed = time.monotonic() - start
        done.set()
        stop.set()
        learner.close()
        for p in actors:
            p.join(30)
            if p.is_alive():
                p.kill()
                exit_code = 1
        reporter.join(5)
        info = reverb.Client(address).server_info(timeout=10)[TABLE]
        server.stop()

    inserted = info.rate_limiter_info.insert_stats.completed
    print(f"\nran {elapsed:.1f} s with {args.actors} actors; the learner sampled through {plane}")
    print(f"  inserts: {inserted} items, {inserted / elapsed:8.0f} items/s, "
          f"{inserted * ITEM_BYTES / elapsed / 1e6:7.1f} MB/s ({steps_written.value / elapsed:.0f} env steps/s)")
    print(f"  samples: {learner.items_sampled} items, {learner.items_sampled / elapsed:8.0f} items/s, "
          f"{learner.items_sampled * ITEM_BYTES / elapsed / 1e6:7.1f} MB/s in {learner.batches} batches")
    print(f"  priority updates: {learner.updates / elapsed:.0f} per second")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
