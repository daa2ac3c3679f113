"""Run a benchmark's ranks as processes of their own on this machine (gloo on 127.0.0.1).

A module that uses it has a `__main__` block calling its rank function with the arguments
`rank world port *args out`; rank 0 writes the ranks' records (a JSON list) to `out`.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def run_ranks(module: str, world: int, args: list[str], what: str) -> list[dict[str, Any]]:
    """Start `world` processes of `python -m module rank world port *args out` (one intra-op
    thread each), wait for all, and return the records rank 0 wrote; RuntimeError naming
    `what` and the exit codes when a rank failed."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", module]
        procs = [
            subprocess.Popen([*argv, str(r), str(world), str(port), *args, str(out)], env=env)
            for r in range(world)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"{what}: rank exit codes {codes}")
        records: list[dict[str, Any]] = json.loads(out.read_text())
    return records
