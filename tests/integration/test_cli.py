"""The trainflow command: config errors exit before any work; a kill cancels the training job;
`trainflow ui` serves the runs' store and artifacts."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from tests.services import (
    background,
    free_port,
    get_json,
    http_status,
    service_env,
    wait_for,
    wait_for_line,
)
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns

# The command itself (its signals, exit codes and output), as a user without the stack runs it.
pytestmark = pytest.mark.integration


def _trainflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainflow.flows.cli", *args]


def test_config_error_exits_2_before_any_work(tmp_path: Path) -> None:
    out = subprocess.run(
        _trainflow("run", "--set", "train.precision=fp8", "--set", f"workdir={tmp_path}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "train.precision" in out.stderr and "'bf16'" in out.stderr
    assert "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir())  # nothing was created


_COUNTED_MODEL = """
import math
import os

import torch
from torch import nn


def counted(spec):
    if torch.get_default_device().type == "meta":  # the preflight check's build
        with open(os.environ["TF_TEST_CHECKS"], "a") as out:
            out.write("checked\\n")
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(spec.sample_shape), spec.num_classes))
"""


def test_the_command_checks_the_users_model_once_and_the_flow_runs_that_config(
    tmp_path: Path,
) -> None:
    """The command builds the config and checks the model (on the meta device) once, before
    Prefect starts, and hands both to the flow: no second build of the config, no second check."""
    (tmp_path / "tf_counted.py").write_text(_COUNTED_MODEL)
    checks = tmp_path / "checks.txt"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TF_TEST_CHECKS": str(checks)}
    argv = _trainflow(
        "run", "--preset", "tiny", "--set", f"workdir={tmp_path / 'work'}",
        "--set", "train.model=tf_counted:counted", "--set", "train.epochs=1",
    )  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("model tf_counted:counted:"), out.stdout[:500]
    assert checks.read_text().splitlines() == ["checked"]


def test_sigterm_cancels_the_training_job_and_marks_runs_killed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.Popen(
        _trainflow(
            "run", "--preset", "tiny", "--set", "train.epochs=5000", "--set", f"workdir={tmp_path}"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = wait_for_line(proc, "epoch 2/5000", limit_s=240)
        # The dask cluster started and stopped by now: none of its INFO lines reached the log
        # (its warnings may: a loaded machine makes the nanny kill a slow worker at shutdown).
        assert "preprocess" in "".join(lines)
        # The tiny dataset (under 64 MiB): preprocessed by threads of the command's process.
        assert "on dask (numpy backend, 2 threads in this process)" in "".join(lines)
        assert [x for x in lines if re.search(r"\| INFO +\| (distributed|dask_cuda)\.", x)] == []
        # Nor MLflow's lines about creating the new workdir's database store.
        assert [x for x in lines if re.search(r" INFO mlflow\.", x)] == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    records = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/jobs/*_rank.json")]
    assert len(records) == 2
    # No rank or controller process of this run survives.
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
    ranks = [int(r[key]) for r in records for key in ("pid", "guard_pid")]
    assert not [p for p in ranks if _alive(p)]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    status = {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}
    assert status == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ui_env() -> dict[str, str]:
    """The test environment minus what would change which store or processes the UI uses."""
    drop = ("MLFLOW_TRACKING_URI", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION")
    return {k: v for k, v in service_env().items() if k not in drop}


def _log_plot(runs: PipelineRuns, folder: Path) -> bytes:
    """Log a small real PNG to the parent run under plots/; return its bytes."""
    path = folder / "dot.png"
    Image.new("RGB", (16, 8), (200, 30, 30)).save(path)
    runs.client.log_artifact(runs.parent_id, str(path), "plots")
    return path.read_bytes()


def _get_bytes(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


def test_ui_serves_the_runs_and_artifacts_of_the_pipeline_store(tmp_path: Path) -> None:
    workdir, cwd = tmp_path / "work", tmp_path / "cwd"
    cwd.mkdir()
    runs = PipelineRuns(TrackingConfig(), workdir, "ui-check")
    png = _log_plot(runs, tmp_path)
    experiment = runs.client.get_experiment(runs.experiment_id)
    assert experiment.artifact_location == (workdir / "mlartifacts").resolve().as_uri()
    port = free_port()
    argv = _trainflow("ui", "--set", f"workdir={workdir}", "--port", str(port))
    log = tmp_path / "ui.log"
    with background(argv, log, _ui_env(), cwd=cwd) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_status(f"{url}/health") == 200, 120, "the MLflow UI")
        assert f"MLflow UI on sqlite:///{workdir}/mlflow.db: {url}" in log.read_text()
        body = get_json(f"{url}/api/2.0/mlflow/runs/get?run_id={runs.parent_id}")
        assert body["run"]["info"]["run_name"] == "ui-check"
        # The UI lists and serves artifacts stored at the run's file:// location.
        listing = get_json(f"{url}/ajax-api/2.0/mlflow/artifacts/list?run_id={runs.parent_id}")
        assert {"path": "plots", "is_dir": True} in listing["files"]
        served = _get_bytes(f"{url}/get-artifact?path=plots/dot.png&run_uuid={runs.parent_id}")
        assert served == png
        # The command became MLflow's own `mlflow ui` (same pid), with one uvicorn worker and
        # no job runner (tasks.tracking.mlflow_server).
        ps = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(proc.pid)], capture_output=True)
        procs = {int(line.split()[0]): line for line in ps.stdout.decode().splitlines()}
        assert " -m mlflow ui " in procs[proc.pid], procs
        others = [line for pid, line in procs.items() if pid != proc.pid]
        assert len(others) == 1 and " -m uvicorn " in others[0], procs
    assert list(cwd.iterdir()) == []  # nothing written where the command was started


def test_ui_without_runs_says_how_to_fix_it(tmp_path: Path) -> None:
    out = subprocess.run(
        _trainflow("ui", "--set", f"workdir={tmp_path}/none", "--port", str(free_port())),
        capture_output=True,
        text=True,
        env=_ui_env(),
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"no runs under {tmp_path}/none yet" in out.stderr
    assert "run `trainflow run` first or pass --set workdir=" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "none").exists()


def test_ui_on_a_tracking_server_prints_its_address_and_starts_nothing(tmp_path: Path) -> None:
    server = "http://mlflow.example.internal:5000"
    out = subprocess.run(
        _trainflow("ui", "--set", f"workdir={tmp_path}", "--port", str(free_port())),
        capture_output=True,
        text=True,
        env={**_ui_env(), "MLFLOW_TRACKING_URI": server},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"open {server}" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_ui_on_a_taken_port_fails_with_a_clear_error(tmp_path: Path) -> None:
    PipelineRuns(TrackingConfig(), tmp_path, "ui-check")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            _trainflow("ui", "--set", f"workdir={tmp_path}", "--port", str(port)),
            capture_output=True,
            text=True,
            env=_ui_env(),
            timeout=120,
        )
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
