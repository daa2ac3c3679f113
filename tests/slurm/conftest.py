"""A real Slurm cluster for every test under tests/slurm: reused if up, started if possible.

Under pytest-xdist each worker has a 2-node cluster of its own (its own base folder and ports,
`worker_cluster`), so Slurm tests run on every worker at once without sharing a queue, a job id
sequence or the nodes' CPUs. A cluster this session starts is stopped when the session ends;
with TRAINFLOW_KEEP_SLURM=1 it is left running for the next session to reuse (`trainflow
cluster down` with the same TRAINFLOW_SLURM_HOME stops it). A cluster that was up before the
session is used and left as it was.
"""

import fcntl
import io
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainflow.cluster.dev.slurm import can_start, is_up, run, slurm_conf, slurm_home

HERE = Path(__file__).parent
NODES = 2
"""Nodes the dev cluster emulates for these tests (as in CI and `make test`)."""
PORT_STRIDE = 10
"""Ports a cluster takes above its slurmctld port: +2 slurmdbd, +3 MariaDB, +3+k node k."""
LEAVE_GRACE_S = 30
"""How long a test's finished jobs may stay in squeue (Slurm sees a job's end within seconds,
longer under load) before they count as left behind."""
UP_LOCK = Path("/var/tmp/trainflow-slurm-up.lock")
"""Held while a cluster starts: apt/dpkg and /etc/hosts take one writer at a time."""


def worker_cluster() -> None:
    """Point this xdist worker (gwN) at a cluster of its own: the base folder `<home>-gwN` and
    the ports `<port> + 10 (N + 1)`, from TRAINFLOW_SLURM_HOME/PORT or the defaults. The one
    pytest process of a run without xdist keeps the plain cluster."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    n = int(worker[2:])
    home = slurm_home()
    os.environ["TRAINFLOW_SLURM_HOME"] = str(home.with_name(f"{home.name}-{worker}"))
    port = int(os.environ.get("TRAINFLOW_SLURM_PORT") or 6817)
    os.environ["TRAINFLOW_SLURM_PORT"] = str(port + PORT_STRIDE * (n + 1))


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker here too, so these tests run under --strict-markers on their own."""
    config.addinivalue_line("markers", "slurm: needs a real Slurm cluster (tests/slurm)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/slurm with `slurm`."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slurm)


KEEP_ENV = "TRAINFLOW_KEEP_SLURM"
"""Set to 1: a dev cluster the tests start stays up after the session."""


def _ensure_cluster() -> bool:
    """Use a running cluster of NODES nodes, or start one (True), or skip (fail in CI) with the
    reason."""
    if is_up(NODES):
        return False
    ok, why = can_start()
    if ok:
        output = io.StringIO()
        with UP_LOCK.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            started = run("up", out=output, nodes=NODES)
        if started != 0:
            pytest.fail(f"`cluster/dev/slurm.sh up` failed:\n{output.getvalue()}", pytrace=False)
        return True
    if os.environ.get("CI"):
        pytest.fail(f"no Slurm cluster in CI: {why}", pytrace=False)
    pytest.skip(f"no Slurm cluster: run `trainflow cluster up` (needs root and apt): {why}")


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster() -> Iterator[Path]:
    """The slurm.conf of a usable cluster, exported as SLURM_CONF for the session."""
    worker_cluster()
    started = _ensure_cluster()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm_conf())
    yield slurm_conf()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
    if started and os.environ.get(KEEP_ENV) != "1":
        run("down", out=io.StringIO())


@pytest.fixture(scope="session", autouse=True)
def _prefect_for_all(prefect_api: str) -> str:
    """Every Slurm test's flows, served flows and jobs use the session's Prefect server."""
    return prefect_api


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(slurm_cluster: Path) -> Iterator[None]:
    """After each test, cancel whatever it left in this worker's own cluster (a test that failed
    half-way, say), so that a leftover job neither trains on through the next tests' CPU time
    nor holds their nodes. Jobs left by a test that passed are a defect: it fails in teardown."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):  # own cluster: all ours
        left = _queued_jobs()
        deadline = time.monotonic() + LEAVE_GRACE_S
        while left and time.monotonic() < deadline:  # a finished job is still R for a moment
            time.sleep(1)
            left = _queued_jobs()
        if left:
            subprocess.run(["scancel", *left], capture_output=True, timeout=30)
            pytest.fail(f"the test left Slurm job(s) {left} queued or running: cancelled")


def _queued_jobs() -> list[str]:
    """Ids of this cluster's jobs that are not just completing (a job a test has cancelled
    passes through CG for up to KillWait)."""
    argv = ["squeue", "-h", "-o", "%i %t"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()[1:] != ["CG"]]


@pytest.fixture
def submitit_folder(tmp_path: Path) -> Path:
    """A fresh submitit folder per test: job ids restart at 1 after a state wipe, so a reused
    folder could hand back an old job's result."""
    folder = tmp_path / "submitit"
    folder.mkdir()
    return folder
