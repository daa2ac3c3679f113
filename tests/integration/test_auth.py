"""Prefect and MLflow servers with authentication, as deploy/production.md sets them up.

Both servers are the real programs: Prefect with an API auth string (HTTP basic), MLflow with
its basic-auth app (a user store, an admin, a service user for pipelines). Requests without
credentials or with wrong ones are refused with 401, and a whole `trainflow run` in a separate
process (its training ranks are processes of their own) logs to both with credentials taken
from the environment only.
"""

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from tests.services import get_json, http_status, mlflow_server, prefect_server, service_env

pytestmark = pytest.mark.integration

PREFECT_AUTH = "trainflow:prefect-secret-8d2f"
ADMIN = ("admin", "admin-secret-71c0")
PIPELINE_USER = ("pipeline", "pipeline-secret-5a9e")
# MLflow's basic-auth app: a user store and an admin created on first start. Every user may
# read everything and manages what they create (with NO_PERMISSIONS the registry's existence
# check of a new model answers 403 instead of 404; see deploy/production.md).
AUTH_INI = """[mlflow]
default_permission = READ
database_uri = sqlite:///{folder}/basic_auth.db
admin_username = {admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""


def basic(user: str, password: str) -> dict[str, str]:
    """An HTTP basic Authorization header."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """POST JSON; the decoded answer, or the HTTP status when it is an error."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code


@dataclass(frozen=True)
class Servers:
    """The API URL of an authenticated Prefect server and the URL of an MLflow one."""

    prefect_api: str
    mlflow: str


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    folder = tmp_path_factory.mktemp("auth")
    ini = folder / "basic_auth.ini"
    ini.write_text(AUTH_INI.format(folder=folder, admin=ADMIN[0]))
    mlflow_env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only-csrf-key-3b1e9f",
    }
    prefect_env = {"PREFECT_SERVER_API_AUTH_STRING": PREFECT_AUTH}
    with (
        prefect_server(folder / "prefect", env=prefect_env) as api,
        mlflow_server(folder / "mlflow", ["--app-name", "basic-auth"], env=mlflow_env) as url,
    ):
        created = post(
            f"{url}/api/2.0/mlflow/users/create",
            {"username": PIPELINE_USER[0], "password": PIPELINE_USER[1]},
            basic(*ADMIN),
        )
        assert isinstance(created, dict), f"creating the pipeline user failed: HTTP {created}"
        yield Servers(api, url)


def test_requests_without_or_with_wrong_credentials_are_refused(servers: Servers) -> None:
    search = f"{servers.mlflow}/api/2.0/mlflow/experiments/search?max_results=1"
    assert http_status(search) == 401
    assert http_status(search, basic(ADMIN[0], "wrong")) == 401
    assert http_status(search, basic("nobody", PIPELINE_USER[1])) == 401
    assert http_status(search, basic(*PIPELINE_USER)) == 200
    version = f"{servers.prefect_api}/admin/version"
    assert http_status(version) == 401
    assert http_status(version, basic("trainflow", "wrong")) == 401
    assert http_status(version, basic(*PREFECT_AUTH.split(":", 1))) == 200
    assert post(f"{servers.prefect_api}/flow_runs/filter", {}) == 401
    # Health probes stay open on both (load balancers and our own start-up checks use them).
    assert http_status(f"{servers.prefect_api}/health") == 200
    assert http_status(f"{servers.mlflow}/health") == 200


def _run_pipeline(servers: Servers, workdir: Path, **credentials: str) -> tuple[int, str]:
    """`trainflow run --preset tiny` in a subprocess against both servers; exit code, output."""
    env = service_env(
        PREFECT_API_URL=servers.prefect_api, MLFLOW_TRACKING_URI=servers.mlflow, **credentials
    )
    for name in ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        if name not in credentials:
            env.pop(name, None)
    argv = [sys.executable, "-m", "flows.cli", "run", "--preset", "tiny"]
    out = subprocess.run(
        [*argv, "--set", f"workdir={workdir}", "--set", f"tracking.experiment={workdir.name}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    (workdir.parent / f"{workdir.name}.log").write_text(out.stdout)
    return out.returncode, out.stdout


def _flow_runs(servers: Servers, workdir: Path) -> list[dict[str, Any]]:
    """The Prefect flow runs whose overrides name this workdir (read with the auth string)."""
    runs = post(f"{servers.prefect_api}/flow_runs/filter", {}, basic(*PREFECT_AUTH.split(":", 1)))
    assert isinstance(runs, list), f"HTTP {runs}"
    return [r for r in runs if f"workdir={workdir}" in r["parameters"].get("overrides", [])]


@pytest.fixture
def admin_client(monkeypatch: pytest.MonkeyPatch, servers: Servers) -> MlflowClient:
    """An MLflow client of the tracking server, logged in as the admin."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    return MlflowClient(servers.mlflow)


def test_pipeline_logs_to_both_servers_with_credentials(
    servers: Servers, admin_client: MlflowClient, tmp_path: Path
) -> None:
    workdir = tmp_path / "with-credentials"
    code, output = _run_pipeline(
        servers,
        workdir,
        PREFECT_API_AUTH_STRING=PREFECT_AUTH,
        MLFLOW_TRACKING_USERNAME=PIPELINE_USER[0],
        MLFLOW_TRACKING_PASSWORD=PIPELINE_USER[1],
    )
    assert code == 0, output[-5000:]
    exp = admin_client.get_experiment_by_name(workdir.name)
    assert exp is not None, output[-3000:]
    runs = {r.info.run_name: r for r in admin_client.search_runs([exp.experiment_id])}
    assert set(runs) == {"tiny", "preprocess", "train", "evaluate"}
    assert all(r.info.status == "FINISHED" for r in runs.values())
    assert runs["tiny"].data.metrics["test_accuracy"] > 0.6
    # Rank 0 of the training job, a process of its own, logged per-epoch metrics.
    history = admin_client.get_metric_history(runs["train"].info.run_id, "train_loss")
    assert [m.step for m in history] == [1, 2]
    # Artifacts went through the server's authenticated artifact proxy.
    names = {a.path for a in admin_client.list_artifacts(runs["evaluate"].info.run_id)}
    assert "confusion_matrix.png" in names
    # Everything was created as the service user, who now manages the experiment.
    granted = f"{servers.mlflow}/api/3.0/mlflow/users/permissions/get?username={PIPELINE_USER[0]}"
    query = f"&resource_type=experiment&resource_id={exp.experiment_id}"
    assert get_json(granted + query, basic(*ADMIN))["permission"] == "MANAGE"
    (flow_run,) = _flow_runs(servers, workdir)
    assert flow_run["state_type"] == "COMPLETED"
    assert flow_run["parameters"]["preset"] == "tiny"


def test_pipeline_with_wrong_credentials_is_refused_before_any_work(
    servers: Servers, admin_client: MlflowClient, tmp_path: Path
) -> None:
    wrong_mlflow = tmp_path / "wrong-mlflow-password"
    code, output = _run_pipeline(
        servers,
        wrong_mlflow,
        PREFECT_API_AUTH_STRING=PREFECT_AUTH,
        MLFLOW_TRACKING_USERNAME=PIPELINE_USER[0],
        MLFLOW_TRACKING_PASSWORD="wrong",
    )
    assert code != 0
    assert "401" in output and "not authenticated" in output, output[-3000:]
    assert admin_client.get_experiment_by_name(wrong_mlflow.name) is None
    assert not (wrong_mlflow / "datasets").exists()  # refused before preprocessing
    (flow_run,) = _flow_runs(servers, wrong_mlflow)
    assert flow_run["state_type"] == "FAILED"

    no_prefect = tmp_path / "no-prefect-auth"
    code, output = _run_pipeline(
        servers,
        no_prefect,
        MLFLOW_TRACKING_USERNAME=PIPELINE_USER[0],
        MLFLOW_TRACKING_PASSWORD=PIPELINE_USER[1],
    )
    assert code != 0
    assert "401" in output, output[-3000:]
    assert _flow_runs(servers, no_prefect) == []
    assert admin_client.get_experiment_by_name(no_prefect.name) is None
