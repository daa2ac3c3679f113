"""tasks.tracking.mlflow_server: MLflow's `mlflow server` command, its uvicorn in the same
process (a real server on a SQLite store; what the stack, `trainflow ui` and the tests run)."""

import signal
from pathlib import Path

import psutil
from mlflow.tracking import MlflowClient

from tests.services import mlflow_server


def test_one_process_serves_runs_and_artifacts_and_stops_on_sigterm(tmp_path: Path) -> None:
    with mlflow_server(tmp_path) as url:
        client = MlflowClient(url)
        run = client.create_run(client.create_experiment("one")).info.run_id
        client.log_metric(run, "m", 0.5)
        client.log_text(run, "proxied to the artifacts destination", "note.txt")
        assert client.get_run(run).data.metrics == {"m": 0.5}
        assert [f.path for f in client.list_artifacts(run)] == ["note.txt"]
        assert list((tmp_path / "mlartifacts").rglob("note.txt"))

        [server] = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "trainflow.tasks.tracking.mlflow_server" in " ".join(p.info["cmdline"] or [])
            and str(tmp_path) in " ".join(p.info["cmdline"] or [])
        ]
        assert server.children() == []  # no uvicorn child, no job runner
        server.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then ends by the signal it caught (as the child did).
        assert server.wait(timeout=30) == -signal.SIGTERM
        assert "Finished server process" in (tmp_path / "mlflow-server.log").read_text()
