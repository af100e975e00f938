"""`make bench-reverb`: the core benchmark against gear and DeepMind Reverb 0.14.0, side by side.

Runs bench/bench_core.py once per backend per round, alternating (gear, reverb,
gear, ...) so both see the same machine state, each in its own process: gear
from this environment, Reverb from ``.venv-reverb`` (``--reverb-python``). Both
runs execute the very same script; only its import differs (``import reverb``
or ``import gear_client as reverb``). Prints each backend's figures (best of
the rounds for each figure) and gear's ratio to Reverb; the goal is >= 2x for
insert and sample throughput, and a ``mutate_priorities`` latency (32 and 256
keys) at most Reverb's (ratio gear / Reverb <= 1x). bench/bench_streams.py adds
the Select round trip against the same goal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_core.py"
GOAL = 2.0
THROUGHPUTS = ("insert_gbps", "insert_flush8_gbps", "sample_b32_gbps", "sample_b256_gbps")
# gear only (Reverb has one sample path): the shared-memory data plane on the same host; no goal.
GEAR_ONLY = ("sample_shm_b32_gbps", "sample_shm_b256_gbps")
LABELS = {"sample_b32_gbps": "sample B=32, network path", "sample_b256_gbps": "sample B=256, network path",
          "sample_shm_b32_gbps": "sample B=32, shm plane", "sample_shm_b256_gbps": "sample B=256, shm plane"}
LATENCIES = ("mutate_b32_ms_median", "mutate_b256_ms_median")


def run_one(python: str, backend: str, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, str(BENCH), "--backend", backend, "--json", out.name, *extra]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=1200)
        for line in proc.stdout.splitlines():  # keep the figures, drop TensorFlow's start-up noise
            if line.startswith(("core benchmark", "  ", f"[{backend}]")):
                print(line)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], file=sys.stderr)
            raise SystemExit(f"{backend} benchmark failed with exit code {proc.returncode}")
        return json.loads(Path(out.name).read_text())


def best(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in THROUGHPUTS + GEAR_ONLY:
        if key in out:
            out[key] = max(r[key] for r in runs)
    for key in LATENCIES:
        out[key] = min(r[key] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reverb-python", default=str(ROOT / ".venv-reverb" / "bin" / "python"))
    parser.add_argument("--gear-python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=3, help="runs per backend (best figure kept)")
    parser.add_argument("--json", help="write both backends' best figures and the ratios here")
    args, extra = parser.parse_known_args(argv)

    runs: dict[str, list[dict]] = {"gear": [], "reverb": []}
    for _ in range(args.rounds):
        runs["gear"].append(run_one(args.gear_python, "gear", extra))
        runs["reverb"].append(run_one(args.reverb_python, "reverb", extra))
    gear, reverb = best(runs["gear"]), best(runs["reverb"])

    print(f"\nside by side, best of {args.rounds} round(s) each ({gear['machine']}):")
    print(f"  {'figure':<40}{'gear':>10}{'reverb':>10}{'ratio':>9}  goal")
    ratios = {}
    for key in THROUGHPUTS + LATENCIES:
        if key in THROUGHPUTS:
            ratio = gear[key] / reverb[key]
            mark = "ok" if ratio >= GOAL else "MISSED"
            unit, goal = "GB/s", f">= {GOAL:g}x {mark}"
        else:
            ratio = gear[key] / reverb[key]  # <= 1: gear is as fast or faster
            mark = "ok" if ratio <= 1.0 else "MISSED"
            unit, goal = "ms", f"<= 1x {mark} (gear / Reverb latency)"
        ratios[key] = ratio
        label = f"{LABELS.get(key, key)} ({unit})"
        print(f"  {label:<40}{gear[key]:>10.3f}{reverb[key]:>10.3f}{ratio:>8.2f}x  {goal}")
    for key in GEAR_ONLY:
        if key in gear:
            label = f"{LABELS[key]} (GB/s)"
            print(f"  {label:<40}{gear[key]:>10.3f}{'-':>10}{'-':>9}   (same host; Reverb has one path)")
    if args.json:
        Path(args.json).write_text(json.dumps({"gear": gear, "reverb": reverb, "ratios": ratios,
                                               "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
