#!/usr/bin/env python3
"""Repack a wheel without some of its top-level folders, its RECORD rewritten to match.

For machines that reach no registry and take files up to a size limit: NIXL's CUDA 13
wheel carries ``nixl_ep_cu13`` (expert-parallel kernels gear does not use), about as big
as the rest together. ``make gpu-wheels`` drops it::

    python tools/repack_wheel.py --drop nixl_ep_cu13 --out .whl nixl_cu13-1.5.1-cp312-...whl

The result keeps the file name (pip reads name, version and tags from it) and installs
with ``pip install --no-deps``; every kept file's hash in RECORD is the original's.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path


def _record_path(names: list[str]) -> str:
    records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise ValueError(f"a wheel has exactly one <name>.dist-info/RECORD; found {records}")
    return records[0]


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(source: Path, out_dir: Path, drop: list[str]) -> Path:
    """Write ``out_dir/<source's name>`` without the top-level folders in ``drop``; returns its path.

    ValueError when a folder to drop is not in the wheel, or the wheel has no single RECORD.
    """
    target = out_dir / source.name
    if target.resolve() == source.resolve():
        raise ValueError("the repacked wheel would overwrite its source: give another --out folder")
    with zipfile.ZipFile(source) as zin:
        infos = zin.infolist()
        names = [i.filename for i in infos]
        record = _record_path(names)
        tops = {n.split("/", 1)[0] for n in names}
        missing = [d for d in drop if d not in tops]
        if missing:
            raise ValueError(f"{source.name} has no top-level {missing} (it has {sorted(tops)})")
        dropped = {d + "/" for d in drop}

        def kept(name: str) -> bool:
            return not any(name.startswith(prefix) for prefix in dropped)

        rows = [row for row in csv.reader(io.StringIO(zin.read(record).decode())) if row and kept(row[0])]
        out_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in infos:
                if not kept(info.filename) or info.filename == record:
                    continue
                zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_DEFLATED)
            text = io.StringIO()
            writer = csv.writer(text, lineterminator="\n")
            for row in rows:
                writer.writerow(row if row[0] != record else [record, "", ""])
            zout.writestr(zin.getinfo(record), text.getvalue().encode(), compress_type=zipfile.ZIP_DEFLATED)
    return target


def check(wheel: Path) -> None:
    """Every file of ``wheel`` is in its RECORD with the right hash, and RECORD names nothing absent."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = _record_path(sorted(names))
        rows = {row[0]: row[1] for row in csv.reader(io.StringIO(z.read(record).decode())) if row}
        for name in names:
            if name.endswith("/") or name == record:
                continue
            if name not in rows:
                raise ValueError(f"{name} is not in RECORD")
            if rows[name] and rows[name] != _hash(z.read(name)):
                raise ValueError(f"{name}'s hash differs from RECORD's")
        absent = [n for n in rows if n not in names]
        if absent:
            raise ValueError(f"RECORD names files the wheel lacks: {absent[:5]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--drop", action="append", required=True, help="a top-level folder to leave out")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the repacked wheel to")
    args = parser.parse_args(argv)
    target = repack(args.wheel, args.out, args.drop)
    check(target)
    print(f"{target}: {args.wheel.stat().st_size >> 20} MiB -> {target.stat().st_size >> 20} MiB "
          f"(without {', '.join(args.drop)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
