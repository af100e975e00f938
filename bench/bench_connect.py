"""`make bench-connect`: connect storms, gear and DeepMind Reverb 0.14 side by side.

N actors start at once, each a thread with its own ``Client`` and an open
``trajectory_writer``, and write 5 items each (one step per item), then flush
and close. The figure is the wall time from the first thread's start to the
last actor's flush, for N = 100, 300 and 1,000. Goal: gear's time at most
Reverb's in the same run. Ceiling, measured in the same run against the same
gear daemon: N threads that each open a bare gRPC channel and make one
ServerInfo call (a connection and a round trip, nothing of a writer).

Each backend runs in its own process (gear from this environment, Reverb from
``.venv-reverb``, see the Makefile's bench-reverb target), alternating per
round so both see the same machine state; the best of the rounds is kept.
Without a Reverb venv only gear's figures are printed. Both backends' modules
are imported before the first storm (Reverb imports everything at ``import
reverb``; gear's ``Client`` module is imported on first use).

Besides the wall time, the CPU time per actor (user + system, every thread)
is printed: gear's actor process plus its daemon process, Reverb's one
process (its server runs in the actors' process). On a machine shared with
other work the wall time varies by 2x between runs; the CPU time much less.

    python bench/bench_connect.py [--actors 100,300,1000] [--rounds 2] [--reverb-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITEMS_PER_ACTOR = 5
RUN_TIMEOUT_S = 900


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _storm(reverb, address: str, actors: int) -> float:
    """Seconds for ``actors`` threads to each connect, open a writer, write and flush 5 items."""
    import numpy as np

    start_gate = threading.Barrier(actors + 1)
    errors: list[BaseException] = []

    def actor(a: int) -> None:
        try:
            start_gate.wait()
            client = reverb.Client(address)
            with client.trajectory_writer(1) as writer:
                for i in range(ITEMS_PER_ACTOR):
                    writer.append({"a": np.int64(a), "i": np.int64(i)})
                    writer.create_item("q", 1.0, {"a": writer.history["a"][-1], "i": writer.history["i"][-1]})
                writer.flush()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=actor, args=(a,), daemon=True) for a in range(actors)]
    for t in threads:
        t.start()
    start_gate.wait()
    started = time.perf_counter()
    for t in threads:
        t.join(RUN_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} actors failed; the first: {errors[0]!r}")
    if any(t.is_alive() for t in threads):
        raise RuntimeError("actors still running after the time limit")
    return elapsed


def _bare_connects(address: str, actors: int) -> float:
    """Seconds for ``actors`` threads to each open a gRPC channel and make one ServerInfo call (the ceiling)."""
    import grpc

    from gear_contract._proto import replay_pb2 as pb
    from gear_contract._proto import replay_pb2_grpc as pb_grpc

    start_gate = threading.Barrier(actors + 1)
    errors: list[BaseException] = []

    def actor() -> None:
        try:
            start_gate.wait()
            with grpc.insecure_channel(address) as channel:
                pb_grpc.ReplayServiceStub(channel).ServerInfo(pb.ServerInfoRequest(), timeout=120,
                                                               wait_for_ready=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=actor, daemon=True) for _ in range(actors)]
    for t in threads:
        t.start()
    start_gate.wait()
    started = time.perf_counter()
    for t in threads:
        t.join(RUN_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} bare connects failed; the first: {errors[0]!r}")
    return elapsed


def run_backend(backend: str, counts: list[int]) -> dict:
    """One backend's storms (in this process): seconds per actor count, and the ceiling's for gear."""
    if backend == "reverb":
        import reverb
    else:
        import gear_client as reverb
    tables = [reverb.Table("q", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                           max_size=ITEMS_PER_ACTOR * max(counts) + 10, rate_limiter=reverb.rate_limiters.MinSize(1))]
    out: dict = {"backend": backend, "storm_s": {}, "ceiling_s": {}, "cpu_ms": {}}
    server = reverb.Server(tables)
    try:
        address = f"localhost:{server.port}"
        _ = reverb.Client, reverb.TrajectoryWriter  # imported before the clock starts, as `import reverb` does
        daemon = getattr(getattr(server, "_process", None), "pid", None)  # gear's daemon; Reverb's is in-process
        for n in counts:
            cpu = time.process_time() + (process_cpu_s(daemon) if daemon else 0.0)
            out["storm_s"][str(n)] = _storm(reverb, address, n)
            cpu = time.process_time() + (process_cpu_s(daemon) if daemon else 0.0) - cpu
            out["cpu_ms"][str(n)] = 1000 * cpu / n
            size = reverb.Client(address).server_info()["q"].current_size
            if size < n * ITEMS_PER_ACTOR:
                raise RuntimeError(f"{backend}: {size} items in the table after {n} actors, expected "
                                   f"{n * ITEMS_PER_ACTOR}")
            reverb.Client(address).reset("q")
            if backend == "gear":
                out["ceiling_s"][str(n)] = _bare_connects(address, n)
    finally:
        server.stop()
    return out


def _run_child(python: str, backend: str, counts: list[int]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(Path(__file__).resolve()), "--backend", backend, "--actors",
               ",".join(str(n) for n in counts), "--json", out.name]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=RUN_TIMEOUT_S * 2, env=env)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], file=sys.stderr)
            raise SystemExit(f"{backend} storm failed with exit code {proc.returncode}")
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", default="100,300,1000", help="comma-separated actor counts")
    parser.add_argument("--rounds", type=int, default=2, help="runs per backend (best time kept)")
    parser.add_argument("--reverb-python", default=str(ROOT / ".venv-reverb" / "bin" / "python"))
    parser.add_argument("--backend", choices=("gear", "reverb"), help=argparse.SUPPRESS)  # one child run
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.actors.split(",") if n.strip()]

    if args.backend is not None:
        result = run_backend(args.backend, counts)
        if args.json:
            Path(args.json).write_text(json.dumps(result))
        print(json.dumps(result))
        return 0

    has_reverb = Path(args.reverb_python).exists()
    runs: dict[str, list[dict]] = {"gear": [], "reverb": []}
    for _ in range(args.rounds):
        runs["gear"].append(_run_child(sys.executable, "gear", counts))
        if has_reverb:
            runs["reverb"].append(_run_child(args.reverb_python, "reverb", counts))

    def best(backend: str, key: str, n: int) -> float | None:
        values = [r[key][str(n)] for r in runs[backend] if str(n) in r.get(key, {})]
        return min(values) if values else None

    cpus = os.cpu_count()
    print(f"connect storm: N actors (a thread each: its own Client, an open trajectory_writer, "
          f"{ITEMS_PER_ACTOR} items, flush), best of {args.rounds} round(s); "
          f"{platform.node()} ({cpus} CPUs), {time.strftime('%Y-%m-%d')}")
    print(f"  {'actors':>7}{'gear s':>10}{'reverb s':>10}{'ratio':>8}{'ceiling s':>11}"
          f"{'gear cpu':>10}{'reverb cpu':>12}  goal: gear <= Reverb (cpu: ms per actor, both sides)")
    nan = float("nan")
    summary = {}
    for n in counts:
        g, r, c = best("gear", "storm_s", n), best("reverb", "storm_s", n), best("gear", "ceiling_s", n)
        gc, rc = best("gear", "cpu_ms", n), best("reverb", "cpu_ms", n)
        ratio = g / r if r else None
        mark = "-" if ratio is None else ("ok" if ratio <= 1.0 else "MISSED")
        print(f"  {n:>7}{g:>10.2f}{r if r is not None else nan:>10.2f}"
              f"{ratio if ratio is not None else nan:>7.2f}x{c:>11.2f}"
              f"{gc if gc is not None else nan:>10.1f}{rc if rc is not None else nan:>12.1f}  {mark}")
        summary[n] = {"gear_s": g, "reverb_s": r, "ratio": ratio, "ceiling_s": c, "gear_cpu_ms": gc,
                      "reverb_cpu_ms": rc}
    if not has_reverb:
        print(f"  (no Reverb venv at {args.reverb_python}: `make bench-reverb` builds .venv-reverb)")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
