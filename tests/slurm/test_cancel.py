"""Cancelling a pipeline never leaves its Slurm job running.

Three ways a run ends early, each against the real cluster: Ctrl-C on `trainflow run`, a
cancel of the Prefect flow run from the API (what the UI's Cancel button does), and a flow
process killed outright (SIGKILL), whose job `trainflow cleanup` cancels.
"""

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from cluster import registry
from tests.services import background, get_json, prefect_server, service_env, wait_for

_LONG = ["--preset", "tiny", "--set", "cluster.executor=slurm", "--set", "train.epochs=5000"]


def _in_squeue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return bool(out.stdout.strip())


def _running_job(workdir: Path) -> str:
    """The recorded Slurm job id once its rank 0 has trained an epoch."""

    def ready() -> str | None:
        jobs = registry.recorded(workdir)
        if not jobs:
            return None
        logs = list(Path(jobs[0].folder).glob(f"{jobs[0].job_id}_0_log.out"))
        return jobs[0].job_id if logs and "epoch 2/" in logs[0].read_text() else None

    return str(wait_for(ready, 240, "the Slurm job to train"))


def _statuses(workdir: Path) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    return {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}


def _long_run(workdir: Path, new_session: bool = False) -> subprocess.Popen[bytes]:
    """`trainflow run` of a long Slurm training in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *_LONG, "--set", f"workdir={workdir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=service_env(),
        start_new_session=new_session,
    )


def test_ctrl_c_on_trainflow_run_cancels_the_slurm_job(tmp_path: Path) -> None:
    proc = _long_run(tmp_path)
    try:
        job_id = _running_job(tmp_path)
        assert _in_squeue(job_id)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    wait_for(lambda: not _in_squeue(job_id), 20, f"job {job_id} to leave squeue")
    assert _statuses(tmp_path) == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}
    assert registry.recorded(tmp_path) == []


def test_killed_flow_process_leaves_a_job_that_cleanup_cancels(tmp_path: Path) -> None:
    proc = _long_run(tmp_path, new_session=True)
    try:
        job_id = _running_job(tmp_path)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # nothing in the flow process can react
        proc.wait()
    assert _in_squeue(job_id)  # the orphan
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "cleanup", "--set", f"workdir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=service_env(),
    )
    assert out.returncode == 0 and f"cancelled slurm job {job_id}" in out.stdout
    wait_for(lambda: not _in_squeue(job_id), 20, f"job {job_id} to leave squeue")


@pytest.fixture
def prefect_api(tmp_path: Path) -> Iterator[str]:
    """A real Prefect server on a free loopback port, SQLite in tmp_path."""
    with prefect_server(tmp_path) as api:
        yield api


def test_cancelling_the_prefect_flow_run_cancels_the_slurm_job(
    tmp_path: Path, prefect_api: str
) -> None:
    env = service_env(PREFECT_API_URL=prefect_api, PREFECT_HOME=str(tmp_path / "prefect-home"))
    serve = [
        sys.executable,
        "-c",
        "from flows.pipeline import pipeline; pipeline.serve(name='cancel-test')",
    ]
    with background(serve, tmp_path / "serve.log", env):
        overrides = json.dumps(
            ["cluster.executor=slurm", "train.epochs=5000", f"workdir={tmp_path / 'work'}"]
        )
        cli = [sys.executable, "-m", "prefect"]

        def deploy() -> str | None:
            out = subprocess.run(
                [
                    *cli,
                    "deployment",
                    "run",
                    "trainflow-pipeline/cancel-test",
                    "--param",
                    "preset=tiny",
                    "--param",
                    f"overrides={overrides}",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            found = re.search(r"UUID:\s*([0-9a-f-]{36})", out.stdout)
            return found.group(1) if out.returncode == 0 and found else None

        flow_run = str(wait_for(deploy, 90, "the deployment to accept a run"))
        job_id = _running_job(tmp_path / "work")
        subprocess.run([*cli, "flow-run", "cancel", flow_run], env=env, check=True, timeout=60)
        wait_for(lambda: not _in_squeue(job_id), 30, f"job {job_id} to leave squeue")

        def state() -> str | None:
            run = get_json(f"{prefect_api}/flow_runs/{flow_run}")
            return run["state"]["type"] if run and run["state"]["type"] == "CANCELLED" else None

        wait_for(state, 60, "the flow run to be Cancelled")
        statuses = wait_for(
            lambda: (s := _statuses(tmp_path / "work")).get("train") == "KILLED" and s,
            30,
            "MLflow to show the runs KILLED",
        )
        assert statuses == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}
