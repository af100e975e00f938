"""Writer throughput: append + create_item against a servicer that discards the data.

Workload (the core benchmark's): ``steps`` appends of {obs: float32[1024], action: int64,
reward: float32}, then one item over ``history[...][-steps:]`` of every leaf;
``items`` times. The figure is item bytes per second of wall time, the final
flush included. The servicer runs in another process (its own GIL) and only
parses the requests and acknowledges the keys: this is the writer's own
ceiling, against the goal of 0.46 GB/s on a 2-core machine. ``--target daemon``
measures against gear's own daemon instead (a FIFO table of 256 items).

    .venv/bin/python bench/bench_writer.py [--items 2048] [--steps 64] [--obs 1024] [--target daemon]
                                           [--pipeline 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time
from concurrent import futures
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL_GBPS = 0.46
# The client's allocator tuning is opt-in for users; the published figures have it on.
os.environ.setdefault("GEAR_MALLOC_TUNING", "1")


def _serve(port_queue: mp.Queue, stop_event: mp.Event) -> None:
    import grpc

    from gear_contract._proto import replay_pb2 as pb
    from gear_contract._proto import replay_pb2_grpc

    class Discard(replay_pb2_grpc.ReplayServiceServicer):
        def InsertStream(self, request_iterator, context):  # noqa: N802
            for request in request_iterator:
                if request.items:
                    yield pb.InsertStreamResponse(keys=[item.key for item in request.items])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", -1)])
    replay_pb2_grpc.add_ReplayServiceServicer_to_server(Discard(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    stop_event.wait()
    server.stop(None)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    port_queue.put(usage.ru_utime + usage.ru_stime)


class _Client:
    def __init__(self, address: str):
        import grpc

        from gear_contract._proto import replay_pb2 as pb
        from gear_contract._proto import replay_pb2_grpc

        self._channel = grpc.insecure_channel(address)
        self._stub = replay_pb2_grpc.ReplayServiceStub(self._channel)
        self._info = pb.TableInfo(name="bench")

    def _table_info(self, name: str, refresh: bool = False):
        return self._info


def run(items: int, steps: int, obs_size: int, target: str = "discard", pipeline: int | None = None) -> dict:
    from gear_client.writers.trajectory_writer import TrajectoryWriter

    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    proc = daemon = None
    if target == "discard":
        proc = ctx.Process(target=_serve, args=(port_queue, stop_event), daemon=True)
        proc.start()
    try:
        if target == "discard":
            port = port_queue.get(timeout=30)
            client = _Client(f"127.0.0.1:{port}")
        else:  # the real daemon: a FIFO table of 256 items
            import gear_client as reverb

            daemon = reverb.Server(tables=[reverb.Table(
                "bench", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(), max_size=256,
                rate_limiter=reverb.rate_limiters.MinSize(1))])
            client = daemon.localhost_client()
        rng = np.random.default_rng(0)
        observations = rng.standard_normal((steps, obs_size)).astype(np.float32)
        actions = [np.int64(i) for i in range(steps)]
        rewards = [np.float32(i) for i in range(steps)]
        step_bytes = obs_size * 4 + 8 + 4
        writer = TrajectoryWriter(client, num_keep_alive_refs=steps)
        # Warm up: open the stream, learn the columns.
        writer.append({"obs": observations[0], "action": actions[0], "reward": rewards[0]})
        writer.create_item("bench", 1.0, {k: writer.history[k][-1:] for k in ("obs", "action", "reward")})
        writer.flush()

        t_append = 0.0
        usage0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(items):
            t0 = time.perf_counter()
            for i in range(steps):
                writer.append({"obs": observations[i], "action": actions[i], "reward": rewards[i]})
            t_append += time.perf_counter() - t0
            history = writer.history
            writer.create_item("bench", 1.0, {
                "obs": history["obs"][-steps:],
                "action": history["action"][-steps:],
                "reward": history["reward"][-steps:],
            })
            if pipeline is not None:
                writer.flush(block_until_num_items=pipeline)
        writer.flush()
        elapsed = time.perf_counter() - start
        usage1 = resource.getrusage(resource.RUSAGE_SELF)
        writer.close()
        stop_event.set()
        server_cpu = port_queue.get(timeout=30) if proc is not None else float("nan")
        total = items * steps * step_bytes
        return {
            "items": items, "steps": steps, "item_bytes": steps * step_bytes, "seconds": elapsed,
            "gbps": total / elapsed / 1e9, "append_us": t_append / (items * steps) * 1e6,
            "item_us": (elapsed - t_append) / items * 1e6,
            "client_cpu": (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime),
            "server_cpu": server_cpu,
        }
    finally:
        stop_event.set()
        if proc is not None:
            proc.join(10)
        if daemon is not None:
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--obs", type=int, default=1024)
    parser.add_argument("--batch-bytes", type=int, default=None,
                        help="override insert_stream.BATCH_BYTES (items per request under load)")
    parser.add_argument("--target", choices=["discard", "daemon"], default="discard",
                        help="discard: a servicer that only acknowledges (the writer's ceiling); daemon: gear's")
    parser.add_argument("--pipeline", type=int, default=None,
                        help="flush(block_until_num_items=N) after each item (a bounded pipeline, as make bench)")
    args = parser.parse_args()
    if args.batch_bytes is not None:
        from gear_client.writers import insert_stream

        insert_stream.BATCH_BYTES = args.batch_bytes
    r = run(args.items, args.steps, args.obs, args.target, args.pipeline)
    print(f"target: {args.target}" + (f", flush(block_until_num_items={args.pipeline}) after each item"
                                      if args.pipeline is not None else ""))
    print(f"writer: {r['items']} items x {r['steps']} steps ({r['item_bytes'] / 1e3:.1f} kB/item) in "
          f"{r['seconds']:.3f} s")
    print(f"  throughput {r['gbps']:.3f} GB/s (goal {GOAL_GBPS} GB/s, {r['gbps'] / GOAL_GBPS:.0%} of goal)")
    print(f"  append {r['append_us']:.2f} us/step, create_item+send {r['item_us']:.1f} us/item")
    print(f"  cpu: writer process {r['client_cpu']:.2f} s, servicer process {r['server_cpu']:.2f} s (whole run; "
          f"nan: not measured)")


if __name__ == "__main__":
    main()
