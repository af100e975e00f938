"""Shared pieces of the operations tests: a tiny real gRPC server and per-method raw calls."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.rpc.event_loop import LoopThread
from gear_server.table.table import ItemToInsert

REPLAY = pb.DESCRIPTOR.services_by_name["ReplayService"]
CALL_TIMEOUT_S = 10.0


def replay_methods() -> list[str]:
    return [m.name for m in REPLAY.methods]


def call_method(channel: grpc.Channel, name: str, metadata=None) -> grpc.StatusCode:
    """Call ReplayService.<name> with an empty request; the status code it ends with."""
    method = REPLAY.methods_by_name[name]
    path = f"/{REPLAY.full_name}/{name}"
    request_cls = getattr(pb, method.input_type.name)
    response_cls = getattr(pb, method.output_type.name)
    kwargs = {"request_serializer": request_cls.SerializeToString, "response_deserializer": response_cls.FromString}
    request = request_cls()
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kwargs)
            list(call(iter([request]), timeout=CALL_TIMEOUT_S, metadata=metadata))
        elif method.client_streaming:
            channel.stream_unary(path, **kwargs)(iter([request]), timeout=CALL_TIMEOUT_S, metadata=metadata)
        elif method.server_streaming:
            list(channel.unary_stream(path, **kwargs)(request, timeout=CALL_TIMEOUT_S, metadata=metadata))
        else:
            channel.unary_unary(path, **kwargs)(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class EchoReplay(pb_grpc.ReplayServiceServicer):
    """Answers every ReplayService call with an empty response (streams: one)."""

    def __getattribute__(self, name: str):
        method = REPLAY.methods_by_name.get(name)
        if method is None:
            return super().__getattribute__(name)
        response = getattr(pb, method.output_type.name)

        if method.server_streaming:
            def stream(request, context) -> Iterator:
                if method.client_streaming:
                    for _ in request:
                        pass
                yield response()
            return stream

        def unary(request, context):
            if method.client_streaming:
                for _ in request:
                    pass
            return response()
        return unary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AioServer:
    """A grpc.aio server on its own event loop thread (as the daemon runs one); ``stop(grace)`` ends both."""

    def __init__(self, interceptors, credentials, add) -> None:
        self.loop = LoopThread("test-aio-server")

        async def build() -> int:
            server = aio.server(futures.ThreadPoolExecutor(8), interceptors=list(interceptors))
            pb_grpc.add_ReplayServiceServicer_to_server(EchoReplay(), server)
            if add is not None:
                add(server)
            if credentials is None:
                port = server.add_insecure_port("127.0.0.1:0")
            else:
                port = server.add_secure_port("127.0.0.1:0", credentials)
            await server.start()
            self.server = server
            return port

        self.port = self.loop.run(build(), timeout=30)

    def stop(self, grace: float | None = None) -> None:
        self.loop.run(self.server.stop(grace), timeout=30)
        self.loop.stop()


def start_server(interceptors=(), credentials=None, add=None) -> tuple[AioServer, int]:
    """A real grpc.aio server on loopback serving EchoReplay (plus whatever ``add(server)`` registers, on its loop)."""
    server = AioServer(interceptors, credentials, add)
    return server, server.port


# ------------------------------------------------------------------ tables ----

SHM_DIR = "/dev/shm"
OBS_ACT = pb.Structure(kind=pb.Structure.DICT, keys=["act", "obs"], children=[pb.Structure(), pb.Structure()])
NO_LIMIT = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1.7976931348623157e308,
                                 max_diff=1.7976931348623157e308)


def table_config(name: str, sampler: pb.SelectorOptions, remover: pb.SelectorOptions, max_size: int = 50,
                 max_times_sampled: int = 0) -> pb.TableConfig:
    return pb.TableConfig(name=name, sampler=sampler, remover=remover, max_size=max_size, rate_limiter=NO_LIMIT,
                          max_times_sampled=max_times_sampled)


def make_item(key: int, priority: float, length: int, episode: int):
    """{'act': int64 scalar (squeezed), 'obs': float32 [length, 3]}; values encode the key."""

    obs = np.arange(length * 3, dtype=np.float32).reshape(length, 3) + 1000 * key
    return ItemToInsert(key=key, priority=priority, structure=OBS_ACT, columns=[np.array(key, np.int64), obs],
                        squeeze=[True, False], episode_ids=frozenset({episode}))


# ------------------------------------------------------------------ daemons ----

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


class DaemonProcess:
    """``python -m gear_server --config FILE`` in a child process, readiness read from a notify socket.

    The daemon's port comes from its READY status line ("... on port N"), so
    configs use ``port = 0``. stderr goes to ``<name>.log`` in the test's folder.
    """

    def __init__(self, folder, config_text: str, name: str = "daemon", env: dict[str, str] | None = None):
        self.folder = folder
        self.config_path = folder / f"{name}.toml"
        self.config_path.write_text(config_text)
        self.log_path = folder / f"{name}.log"
        self.notify_path = folder / f"{name}.notify"
        if self.notify_path.exists():
            self.notify_path.unlink()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.messages: list[str] = []
        child_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path), **(env or {})}
        child_env["PYTHONPATH"] = str(ROOT) + os.pathsep + child_env.get("PYTHONPATH", "")
        child_env.pop("JOURNAL_STREAM", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen([sys.executable, "-m", "gear_server", "--config", str(self.config_path)],
                                        stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, env=child_env)
        self.port: int | None = None

    def wait_for(self, prefix: str, timeout: float = START_TIMEOUT_S) -> str:
        """The next notify datagram holding a line that starts with ``prefix`` (all are kept in ``messages``)."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages:
                if any(line.startswith(prefix) for line in message.split("\n")):
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.process.poll() is not None and not self._drain(0.2):
                raise AssertionError(f"no {prefix!r} from the daemon (exit code {self.process.poll()}); "
                                     f"log:\n{self.log}")
            self._drain(min(remaining, 0.5))

    def _drain(self, timeout: float) -> bool:
        self.notify.settimeout(timeout)
        try:
            self.messages.append(self.notify.recv(65536).decode())
            return True
        except TimeoutError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> int:
        message = self.wait_for("READY=1", timeout)
        self.port = int(re.search(r"on port (\d+)", message).group(1))
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=None, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig or signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        if self.notify.fileno() >= 0:
            while self._drain(0.05):  # keep what the daemon said on its way out
                pass
            self.notify.close()
            self._log.close()


def tables_toml(instance: str) -> str:
    """A queue (insertion order) and a prioritized table, served on loopback."""
    return f'''
bind_address = "127.0.0.1"
port = 0
instance_name = "{instance}"

[[tables]]
name = "queue"
preset = "queue"
max_size = 100

[[tables]]
name = "prio"
sampler = {{ prioritized = {{ priority_exponent = 1.0 }} }}
remover = "fifo"
max_size = 100
rate_limiter = {{ min_size = 1 }}
'''


def insert_items(client, values) -> None:
    """One item per value into both tables: obs = [v]*4, priority v + 1 in 'prio'."""
    for v in values:
        client.insert({"obs": np.full(4, v, np.float32)}, priorities={"queue": 1.0, "prio": float(v) + 1.0})


def drain_queue(client, n: int) -> list[int]:
    """The values of the next n items of 'queue' (FIFO: insertion order)."""
    samples = list(client.sample("queue", num_samples=n, emit_timesteps=False))
    return [int(np.asarray(s.data[0]).reshape(-1)[0]) for s in samples]
