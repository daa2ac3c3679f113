"""tasks.tracking.mlflow_server: MLflow's `mlflow server` as trainflow starts it (a real server on
a SQLite store; what the stack, `trainflow ui` and the tests run)."""

import os
import signal
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.services import mlflow_server


def _server_processes(folder: Path) -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(folder) in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid()
    ]


@pytest.mark.services
def test_the_server_serves_runs_and_artifacts_and_its_group_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    with mlflow_server(tmp_path) as url:
        client = MlflowClient(url)
        run = client.create_run(client.create_experiment("one")).info.run_id
        client.log_metric(run, "m", 0.5)
        client.log_text(run, "proxied to the artifacts destination", "note.txt")
        assert client.get_run(run).data.metrics == {"m": 0.5}
        assert [f.path for f in client.list_artifacts(run)] == ["note.txt"]
        assert list((tmp_path / "mlartifacts").rglob("note.txt"))

        processes = _server_processes(tmp_path)
        assert processes  # `mlflow server` and its uvicorn; no job runner
        assert not any("huey" in " ".join(p.cmdline()) for p in processes)
        os.killpg(os.getpgid(processes[0].pid), signal.SIGTERM)
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert alive == []
