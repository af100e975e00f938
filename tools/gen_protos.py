"""Generate the control-plane modules from protos/ into gear_contract/_proto/.

The generated modules are committed (the GPU machine has no grpcio-tools);
``--check`` regenerates into a temporary folder and fails when the committed
files differ, so a proto change without regeneration cannot land.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "gear_contract" / "_proto"
# (proto path relative to protos/, module stem in gear_contract/_proto/). Health and
# reflection come from their libraries (grpcio-health-checking, grpcio-reflection).
PROTOS = [
    ("gear/v1/replay.proto", "replay"),
]


def _generate(dest: Path) -> list[Path]:
    """Run protoc for every proto and write flat, relatively-imported modules into dest."""
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for rel, _ in PROTOS:
            cmd = [
                sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                str(PROTO_ROOT / rel),
            ]
            subprocess.run(cmd, check=True)
        for rel, stem in PROTOS:
            src_dir = Path(tmp) / Path(rel).parent
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                text = (src_dir / f"{Path(rel).stem}{suffix}").read_text()
                # Absolute imports of sibling generated modules become relative.
                for other_rel, other_stem in PROTOS:
                    other_pkg = ".".join(Path(other_rel).parent.parts)
                    text = text.replace(f"from {other_pkg} import {Path(other_rel).stem}_pb2 ",
                                        f"from . import {other_stem}_pb2 ")
                target = dest / f"{stem}{suffix}"
                target.write_text(text)
                written.append(target)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for path in _generate(OUT_DIR):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh in _generate(Path(tmp)):
            committed = OUT_DIR / fresh.name
            if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                stale.append(committed.relative_to(ROOT))
        if stale:
            print("generated modules do not match protos/: run `make proto`:", *stale, sep="\n  ")
            return 1
    print("generated modules match protos/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
