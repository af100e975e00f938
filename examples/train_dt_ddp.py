"""`make example-ddp`: a decision transformer trained with DDP on trajectories replayed from gear.

What runs, all on this machine, all stopped at the end:
  * a gear daemon (``reverb.Server``, a child process) with one uniform table of K-step trajectories;
  * actor processes playing a toy control task and writing, per step, the observation, action, reward and
    return-to-go; each item holds K steps (about 270 KiB with the defaults);
  * W learner ranks (one process per GPU with ``--device cuda`` over NCCL; CPU processes over gloo otherwise)
    training a small decision transformer (a causal transformer over (return-to-go, observation, action)
    tokens, predicting each step's action) wrapped in DistributedDataParallel. Each rank reads its rows of
    one global selection straight into its device: TrajectoryDataset takes rank and world size from
    torch.distributed, ``device="cuda:<rank>"`` gathers on the GPU, ``columns=`` fetches only the fields the
    model reads (the rewards stay in the table).

In turns with replay, the same ranks train on synthetic input: copies of a few replayed batches kept in device
memory, no input pipeline at all (the ceiling). The run prints both modes' steps/s and the fraction of the step
time each rank waited on replay, against the goal (<= 5%).

    python examples/train_dt_ddp.py --world-size 2 --steps 50      # CPU, gloo
    NCCL_NVLS_ENABLE=0 python3 examples/train_dt_ddp.py --device cuda   # one rank per GPU, NCCL
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
from pathlib import Path

import numpy as np

if importlib.util.find_spec("gear_client") is None:  # run from the source tree without an installed gear
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gear_client as reverb  # noqa: E402

TABLE = "trajectories"
FIELDS = ("observation", "action", "return_to_go")  # what the model reads; "reward" is in the items too
WAIT_GOAL = 0.05  # replay wait <= 5% of the step time
ROUNDS = 5  # the two modes alternate this many times


# ---------------------------------------------------------------- actors
def actor(address: str, actor_id: int, args: argparse.Namespace, stop) -> None:
    """Play episodes of a noisy linear control task; write K-step items of (obs, action, reward, return-to-go)."""
    k, period = args.context, max(1, args.context // 4)
    episode = 2 * k
    expert = np.random.default_rng(0).standard_normal((args.obs_dim, args.act_dim), dtype=np.float32)
    expert /= np.sqrt(args.obs_dim)  # the same expert policy in every actor
    rng = np.random.default_rng(1000 + actor_id)
    client = reverb.Client(address)
    with client.trajectory_writer(num_keep_alive_refs=k) as writer:
        while not stop.is_set():
            noise = rng.uniform(0.0, 1.0)  # how far this episode's behaviour strays from the expert
            obs = np.empty((episode, args.obs_dim), np.float32)
            obs[0] = rng.standard_normal(args.obs_dim, dtype=np.float32)
            for t in range(1, episode):
                obs[t] = 0.9 * obs[t - 1] + 0.3 * rng.standard_normal(args.obs_dim, dtype=np.float32)
            best = np.tanh(obs @ expert)
            action = np.clip(best + noise * rng.standard_normal(best.shape, dtype=np.float32), -1, 1)
            reward = -np.square(action - best).mean(axis=1)
            rtg = np.cumsum(reward[::-1])[::-1].astype(np.float32) / episode
            for t in range(episode):
                writer.append({"observation": obs[t], "action": action[t], "reward": reward[t],
                               "return_to_go": rtg[t]})
                if t + 1 >= k and (t + 1 - k) % period == 0:
                    writer.create_item(TABLE, priority=1.0,
                                       trajectory={name: writer.history[name][-k:] for name in (*FIELDS, "reward")})
            writer.end_episode(timeout_ms=30_000)


# ---------------------------------------------------------------- model and training (in each rank)
def make_model(args: argparse.Namespace):
    import torch
    from torch import nn

    class DecisionTransformer(nn.Module):
        """Tokens (rtg_t, obs_t, act_t) per step, causal attention; each step's action read off its obs token."""

        def __init__(self) -> None:
            super().__init__()
            d = args.d_model
            self.rtg, self.obs = nn.Linear(1, d), nn.Linear(args.obs_dim, d)
            self.act, self.time = nn.Linear(args.act_dim, d), nn.Embedding(args.context, d)
            layer = nn.TransformerEncoderLayer(d, args.heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, args.act_dim)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(3 * args.context),
                                 persistent=False)

        def forward(self, obs, action, rtg):
            b, k = obs.shape[:2]
            t = self.time(torch.arange(k, device=obs.device))
            tokens = torch.stack([self.rtg(rtg[..., None]) + t, self.obs(obs) + t, self.act(action) + t], dim=2)
            h = self.body(tokens.reshape(b, 3 * k, -1), mask=self.mask, is_causal=True)
            return torch.tanh(self.head(h[:, 1::3]))

    return DecisionTransformer()


class Meter:
    """Measured steps of one mode: time in next_batch, time in whole steps, losses."""

    def __init__(self) -> None:
        self.steps, self.waited, self.total, self.losses = 0, 0.0, 0.0, []

    def figures(self) -> dict:
        return {"steps_per_s": self.steps / self.total, "wait": self.waited / self.total,
                "loss": (self.losses[0], self.losses[-1])}


def train(model, optimizer, next_batch, steps: int, sync, meter: Meter | None) -> None:
    """``steps`` training steps; timed into ``meter`` (None: warm-up, not measured)."""
    import torch.nn.functional as F

    for _ in range(steps):
        t0 = time.perf_counter()
        obs, action, rtg = next_batch()
        t1 = time.perf_counter()
        loss = F.mse_loss(model(obs, action, rtg), action)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        sync()
        if meter is not None:
            meter.steps += 1
            meter.waited, meter.total = meter.waited + t1 - t0, meter.total + time.perf_counter() - t0
            meter.losses.append(float(loss.detach()))


def rank_main(rank: int, args: argparse.Namespace, address: str, results) -> None:
    """One DDP rank: replay and synthetic modes in turns; its figures go to ``results``."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; same seed keeps runs comparable
        model = DistributedDataParallel(make_model(args).to(device), device_ids=[rank] if cuda else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

        # Replay: this rank's rows of one global selection per step (rank and world from torch.distributed),
        # only the model's fields, gathered straight into this rank's device.
        with reverb.TrajectoryDataset(address, TABLE, args.batch, device=f"cuda:{rank}" if cuda else None,
                                      output="torch", columns=list(FIELDS), seed=args.seed,
                                      rate_limiter_timeout_ms=args.timeout * 1000) as dataset:
            def next_replay():
                sample = next(dataset, None)
                if sample is None:
                    raise RuntimeError(f"replay ended: nothing could be sampled for --timeout {args.timeout} s")
                return sample.data["observation"], sample.data["action"], sample.data["return_to_go"]

            first = next(dataset)
            fetched = sorted(first.data)
            batch_bytes = sum(first.data[name].nbytes for name in fetched)
            # Synthetic: the same training on batches already in device memory (copies of 4 replayed batches,
            # so both modes learn the same task), with no input pipeline at all: the ceiling.
            pool = [tuple(t.clone() for t in next_replay()) for _ in range(4)]
            counter = iter(range(1 << 62))

            def next_synthetic():
                return pool[next(counter) % len(pool)]

            # The modes take turns, in rounds, so that both see the same machine (load, clocks, actors).
            replay, synthetic = Meter(), Meter()
            train(model, optimizer, next_replay, args.warmup, sync, None)
            train(model, optimizer, next_synthetic, args.warmup, sync, None)
            for r in range(ROUNDS):
                steps = args.steps // ROUNDS + (r < args.steps % ROUNDS)
                train(model, optimizer, next_replay, steps, sync, replay)
                train(model, optimizer, next_synthetic, steps, sync, synthetic)
            plane = dataset.plane

        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        results.put({"rank": rank, "replay": replay.figures(), "synthetic": synthetic.figures(), "fields": fetched,
                     "plane": plane, "batch_bytes": batch_bytes, "checksum": checksum})
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the run
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_all(processes: list) -> None:
    """Join each process briefly; terminate, then kill, what is still alive."""
    for p in processes:
        p.join(10)
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_ranks(ctx, args: argparse.Namespace, address: str) -> list[dict]:
    """Start the W ranks and collect their figures; fails (and stops them) when one dies or time runs out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    results = ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, args, address, results), name=f"rank-{r}", daemon=True)
             for r in range(args.world_size)]
    for p in ranks:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(got) < args.world_size:
            try:
                figures = results.get(timeout=1.0)
                got[figures["rank"]] = figures
                continue
            except queue.Empty:
                pass
            failed = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(ranks)
                      if p.exitcode is not None and (p.exitcode != 0 or r not in got)]
            if failed:
                raise RuntimeError(f"learner rank failed: {', '.join(failed)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within --timeout {args.timeout} s")
    finally:
        stop_all(ranks)
    return [got[r] for r in range(args.world_size)]


def wait_for_items(address: str, count: int, timeout: float, actors: list) -> int:
    """Block until the table holds ``count`` items (the ranks then start on a filled table)."""
    client = reverb.Client(address)
    deadline = time.monotonic() + timeout
    while (size := client.server_info(timeout=10)[TABLE].current_size) < count:
        if not any(p.is_alive() for p in actors):
            raise RuntimeError("every actor died before the table was filled")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the table holds {size} of {count} items after {timeout} s")
        time.sleep(0.2)
    return size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank per GPU, NCCL")
    parser.add_argument("--world-size", type=int, help="ranks (default: every GPU with cuda, 2 on cpu)")
    parser.add_argument("--steps", type=int, default=50, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per mode")
    parser.add_argument("--batch", type=int, help="items per rank per step (default 64 cuda, 8 cpu)")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--context", type=int, default=64, help="K: steps per item and per model input")
    parser.add_argument("--obs-dim", type=int, default=1024)
    parser.add_argument("--act-dim", type=int, default=16)
    parser.add_argument("--d-model", type=int, help="default 512 cuda, 64 cpu")
    parser.add_argument("--layers", type=int, help="default 6 cuda, 2 cpu")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--table-size", type=int, default=2048, help="items the table keeps (FIFO)")
    parser.add_argument("--seed", type=int, default=1, help="the global selection's seed")
    parser.add_argument("--timeout", type=int, default=600, help="seconds before the run gives up")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            parser.error("--device cuda: torch sees no GPU")
        args.world_size = gpus if args.world_size is None else args.world_size
        if args.world_size > gpus:
            parser.error(f"--world-size {args.world_size}: one rank per GPU, and torch sees {gpus}")
    args.world_size = 2 if args.world_size is None else args.world_size
    args.batch = args.batch or (64 if cuda else 8)
    args.d_model = args.d_model or (512 if cuda else 64)
    args.layers = args.layers or (6 if cuda else 2)
    for name in ("world_size", "steps", "batch", "actors", "context", "obs_dim", "act_dim", "heads", "timeout"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.table_size < args.world_size * args.batch:
        parser.error(f"--table-size {args.table_size} is below one global batch ({args.world_size * args.batch})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off unless the caller chose otherwise
    item_bytes = args.context * (args.obs_dim + args.act_dim + 2) * 4
    table = reverb.Table(TABLE, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                         max_size=args.table_size,
                         rate_limiter=reverb.rate_limiters.MinSize(args.world_size * args.batch))
    server = reverb.Server([table], port=None)
    address = f"localhost:{server.port}"
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    actors = [ctx.Process(target=actor, args=(address, i, args, stop), name=f"actor-{i}", daemon=True)
              for i in range(args.actors)]
    print(f"daemon on {address}; {args.actors} actors writing items of {args.context} steps "
          f"({item_bytes / 1024:.0f} KiB); {args.world_size} ranks on {args.device} "
          f"({'nccl' if args.device == 'cuda' else 'gloo'}), {args.batch} items per rank per step", flush=True)
    try:
        for p in actors:
            p.start()
        filled = wait_for_items(address, min(args.table_size, 4 * args.world_size * args.batch), args.timeout, actors)
        print(f"table holds {filled} items; training {args.warmup}+{args.steps} steps per mode", flush=True)
        figures = run_ranks(ctx, args, address)
    finally:
        stop.set()
        stop_all(actors)
        server.stop()

    if len({f["checksum"] for f in figures}) != 1:
        print(f"ranks' parameters differ: {[f['checksum'] for f in figures]}", file=sys.stderr)
        return 1
    first = figures[0]
    replay, synthetic = first["replay"], first["synthetic"]
    waits = [f["replay"]["wait"] for f in figures]
    print(f"each rank fetched {', '.join(first['fields'])} over {first['plane']}: "
          f"{first['batch_bytes'] / 1024:.0f} KiB per batch of {args.batch} items "
          f"(whole items {args.batch * item_bytes / 1024:.0f} KiB)")
    print(f"replay:    {replay['steps_per_s']:8.2f} steps/s, loss {replay['loss'][0]:.4f} -> {replay['loss'][1]:.4f}, "
          f"waited on replay {100 * max(waits):.1f}% of step time (max over ranks; mean {100 * np.mean(waits):.1f}%)")
    print(f"synthetic: {synthetic['steps_per_s']:8.2f} steps/s (4 batches kept in {args.device} memory; "
          f"loss {synthetic['loss'][0]:.4f} -> {synthetic['loss'][1]:.4f})")
    print(f"replay runs at {replay['steps_per_s'] / synthetic['steps_per_s']:.2f} of synthetic; goal: replay wait "
          f"<= {100 * WAIT_GOAL:.0f}% of step time: {'met' if max(waits) <= WAIT_GOAL else 'NOT met'}")
    print(f"parameters identical on all {args.world_size} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
