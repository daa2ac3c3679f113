"""The dev Slurm cluster works end to end: scheduler, fake GPUs, accounting and submitit."""

import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

from trainflow.cluster.dev.slurm import run

# Each test is bounded: a broken cluster must fail them, never hang them.
pytestmark = pytest.mark.timeout(90)
# Jobs unpickle these helpers by value, so they do not depend on the job's working directory.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _add(a: int, b: int) -> int:
    return a + b


def _rank() -> tuple[int, int]:
    env = submitit.JobEnvironment()
    return env.global_rank, env.num_tasks


def _cmd(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=30).stdout


def _nodes() -> list[dict[str, str]]:
    """`scontrol show node` of every node, each as key -> value."""
    lines = _cmd("scontrol", "show", "node", "-o").splitlines()
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines if line.strip()]


def _node() -> dict[str, str]:
    """The first node (all nodes of the dev cluster are alike)."""
    return _nodes()[0]


def _executor(folder: Path, **params: object) -> submitit.SlurmExecutor:
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**{"time": 5, "ntasks_per_node": 1, "cpus_per_task": 1, **params})
    return executor


def _wait_for(what: str, probe: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout_s:.0f}s")
        time.sleep(0.5)


def _sacct_state(job_id: str) -> str:
    return _cmd("sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id).strip()


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory: pytest.TempPathFactory) -> submitit.Job[int]:
    """A trivial function run through Slurm, its result already collected."""
    job = _executor(tmp_path_factory.mktemp("submitit")).submit(_add, 2, 3)
    assert job.result() == 5
    return job


def test_status_exits_zero() -> None:
    output = io.StringIO()
    assert run("status", out=output) == 0, output.getvalue()


def test_two_nodes_share_8_cpus_and_have_2_fake_gpus_each() -> None:
    nodes = _nodes()
    assert [n["NodeName"] for n in nodes] == ["tfnode1", "tfnode2"]
    for node in nodes:
        base_state, *flags = node["State"].split("+")
        # Others may be running jobs on the shared dev cluster: mixed or allocated is fine too.
        assert base_state in {"IDLE", "MIXED", "ALLOCATED"}, node["State"]
        assert not set(flags) - {"COMPLETING", "PLANNED"}, node["State"]
        assert node["CPUTot"] == "4"
        assert node["Gres"] == "gpu:2"


def _where() -> tuple[str, str]:
    return os.environ["SLURMD_NODENAME"], os.environ["SLURM_NODEID"]


def test_a_two_node_job_runs_one_task_on_each_node(submitit_folder: Path) -> None:
    job = _executor(submitit_folder, nodes=2).submit(_where)
    assert sorted(job.results()) == [("tfnode1", "0"), ("tfnode2", "1")]


def test_submitted_function_returns_its_result(finished_job: submitit.Job[int]) -> None:
    assert finished_job.result() == 5
    assert finished_job.job_id.isdigit()


def test_sacct_reports_the_job_completed(finished_job: submitit.Job[int]) -> None:
    _wait_for("COMPLETED in sacct", lambda: _sacct_state(finished_job.job_id) == "COMPLETED")


def test_two_tasks_see_global_ranks_0_and_1(submitit_folder: Path) -> None:
    job = _executor(submitit_folder, ntasks_per_node=2).submit(_rank)
    assert sorted(job.results()) == [(0, 2), (1, 2)]


def test_memory_above_real_memory_is_rejected_at_submit(submitit_folder: Path) -> None:
    too_much = int(_node()["RealMemory"]) + 1024
    executor = _executor(submitit_folder, mem=f"{too_much}M")
    with pytest.raises(FailedJobError, match="node configuration is not available"):
        executor.submit(_add, 1, 1)


def test_scancel_makes_result_raise_cancelled(submitit_folder: Path) -> None:
    job = _executor(submitit_folder).submit(time.sleep, 300)
    try:
        _wait_for("the job RUNNING", lambda: _sacct_state(job.job_id) == "RUNNING")
        _cmd("scancel", job.job_id)
        with pytest.raises(UncompletedJobError, match="CANCELLED"):
            job.result()
    finally:
        job.cancel(check=False)


def test_trainflow_cluster_status_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trainflow.flows.cli", "cluster", "status"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "idle" in out.stdout or "mix" in out.stdout or "alloc" in out.stdout
