"""Typed handle on cluster/dev/slurm.sh: start, stop and probe the dev Slurm cluster (N nodes).

The shell script does the work (packages, configs, daemons); this module finds it, runs it with
its output streamed, and answers "is a usable cluster there?" without starting anything.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal, TextIO

SCRIPT: Path = Path(__file__).with_name("slurm.sh")
DEFAULT_HOME = Path("/var/tmp/trainflow-slurm")
# Node states (sinfo %T) in which the node takes or runs jobs.
USABLE_STATES = frozenset({"idle", "mixed", "allocated", "completing", "planned"})

Action = Literal["up", "down", "status"]


def slurm_home() -> Path:
    """The base folder holding the cluster's configs, state, logs and database."""
    return Path(os.environ.get("TRAINFLOW_SLURM_HOME") or DEFAULT_HOME)


def slurm_conf() -> Path:
    """The slurm.conf Slurm clients need in SLURM_CONF to reach this cluster."""
    return slurm_home() / "etc" / "slurm.conf"


def run(
    action: Action, out: TextIO | None = None, nodes: int | None = None, fresh: bool = False
) -> int:
    """Run `slurm.sh <action>`, streaming its output line by line to `out` (default: stdout).

    `nodes` and `fresh` apply to "up" (None: the count the cluster had, else 2). Returns the
    script's exit status: for "status", 0 only when the cluster and every node are usable.
    """
    sink = out if out is not None else sys.stdout
    argv = ["bash", str(SCRIPT), action]
    if action == "up":
        argv += ["--fresh"] if fresh else []
        argv += ["--nodes", str(nodes)] if nodes is not None else []
    with subprocess.Popen(
        argv,
        # The script renders its configs with this Python (cluster/dev/slurm_config.py).
        env={**os.environ, "TRAINFLOW_PYTHON": sys.executable},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            sink.flush()
        return proc.wait()


def can_start() -> tuple[bool, str]:
    """Whether this machine can install and start the cluster; if not, the reason."""
    if os.geteuid() != 0:
        return False, "starting Slurm needs root (packages, the munge user, daemons as root)"
    if shutil.which("apt-get") is None:
        return False, "starting Slurm needs apt-get (a Debian or Ubuntu machine)"
    return True, ""


def is_up(nodes: int = 1) -> bool:
    """Whether the cluster's slurm.conf exists and sinfo reports at least `nodes` nodes that
    take jobs."""
    return len(usable_nodes()) >= nodes


def usable_nodes() -> list[str]:
    """Names of the nodes that take jobs (empty when no cluster answers)."""
    conf = slurm_conf()
    if not conf.is_file() or shutil.which("sinfo") is None or not _controller_listens(conf):
        return []
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"],
            env={**os.environ, "SLURM_CONF": str(conf)},
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return []
    if proc.returncode != 0:
        return []
    rows = [line.split() for line in proc.stdout.splitlines()]
    return sorted({r[0] for r in rows if len(r) == 2 and r[1].rstrip("*~#") in USABLE_STATES})


def _controller_listens(conf: Path) -> bool:
    """Whether slurmctld's port answers: without it sinfo retries for ~10 s before failing."""
    found = re.search(r"^SlurmctldPort=(\d+)", conf.read_text(), flags=re.MULTILINE)
    port = int(found.group(1)) if found else 6817
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False
