"""py-spy around benchmark processes (the GPU machine: `make gpu-wheels` carries py-spy's wheel)."""

from __future__ import annotations

import os
import subprocess

PYSPY = os.environ.get("PYSPY", "/tmp/site/bin/py-spy")


def spy(pid: int, out_dir: str, name: str, seconds: float) -> subprocess.Popen:
    """Record ``pid`` for ``seconds`` as raw folded stacks per thread into ``out_dir/name.txt``.

    ``GIL=1`` samples only the thread holding the GIL (who keeps the interpreter busy);
    otherwise every thread, idle ones included (who waits on what).
    """
    which = ["--gil"] if os.environ.get("GIL") == "1" else ["--idle"]
    log = open(os.path.join(out_dir, f"{name}.log"), "w")  # noqa: SIM115 - handed to the child
    return subprocess.Popen([PYSPY, "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw",
                             "-t", *which, "--nonblocking", "-o", os.path.join(out_dir, f"{name}.txt")],
                            stdout=log, stderr=subprocess.STDOUT)
