"""Cancelling a pipeline never leaves its Slurm job running.

Three ways a run ends early, each against the real cluster: Ctrl-C on `trainflow run`, a
cancel of the Prefect flow run from the API (what the UI's Cancel button does), and a flow
process killed outright (SIGKILL), whose job `trainflow cleanup` cancels.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from cluster import registry

_LONG = ["--preset", "tiny", "--set", "cluster.executor=slurm", "--set", "train.epochs=5000"]


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **extra,
    }


def _wait(predicate: Callable[[], Any], limit_s: float, what: str) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {limit_s} s waiting for {what}")


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

    return str(_wait(ready, 240, "the Slurm job to train"))


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
        env=_env(),
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
    _wait(lambda: not _in_squeue(job_id), 20, f"job {job_id} to leave squeue")
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
        env=_env(),
    )
    assert out.returncode == 0 and f"cancelled slurm job {job_id}" in out.stdout
    _wait(lambda: not _in_squeue(job_id), 20, f"job {job_id} to leave squeue")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.load(resp)
    except OSError:
        return None


@pytest.fixture
def prefect_api(tmp_path: Path) -> Iterator[str]:
    """A real Prefect server on a free loopback port, SQLite in tmp_path."""
    port = _free_port()
    env = _env(
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path}/prefect.db",
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait(lambda: _get(f"{api}/health"), 90, "the Prefect server")
        yield api
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)


def test_cancelling_the_prefect_flow_run_cancels_the_slurm_job(
    tmp_path: Path, prefect_api: str
) -> None:
    env = _env(PREFECT_API_URL=prefect_api, PREFECT_HOME=str(tmp_path / "prefect"))
    serve = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from flows.pipeline import pipeline; pipeline.serve(name='cancel-test')",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
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

        flow_run = str(_wait(deploy, 90, "the deployment to accept a run"))
        job_id = _running_job(tmp_path / "work")
        subprocess.run([*cli, "flow-run", "cancel", flow_run], env=env, check=True, timeout=60)
        _wait(lambda: not _in_squeue(job_id), 30, f"job {job_id} to leave squeue")

        def state() -> str | None:
            run = _get(f"{prefect_api}/flow_runs/{flow_run}")
            return run["state"]["type"] if run and run["state"]["type"] == "CANCELLED" else None

        _wait(state, 60, "the flow run to be Cancelled")
        statuses = _wait(
            lambda: (s := _statuses(tmp_path / "work")).get("train") == "KILLED" and s,
            30,
            "MLflow to show the runs KILLED",
        )
        assert statuses == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(timeout=60)
