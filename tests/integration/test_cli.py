"""The trainflow command: config errors exit before any work; a kill cancels the training job."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking.config import TrackingConfig
from tasks.tracking.pipeline_runs import PipelineRuns

pytestmark = pytest.mark.integration


def _trainflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


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


def _wait_for_line(proc: subprocess.Popen[str], needle: str, limit_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + limit_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never appeared:\n{''.join(lines[-30:])}")


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
        _wait_for_line(proc, "epoch 2/5000", limit_s=240)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    # No rank or controller process of this run survives.
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    status = {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}
    assert status == {"tiny": "KILLED", "preprocess": "FINISHED", "train": "KILLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ui_command_serves_the_pipeline_store(tmp_path: Path) -> None:
    runs = PipelineRuns(TrackingConfig(), tmp_path, "ui-check")
    port = _free_port()
    proc = subprocess.Popen(
        _trainflow("ui", "--set", f"workdir={tmp_path}", "--port", str(port)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={runs.parent_id}"
    try:
        body = _poll_json(url, limit_s=90)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert body["run"]["info"]["run_name"] == "ui-check"


def _poll_json(url: str, limit_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return dict(json.load(resp))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
