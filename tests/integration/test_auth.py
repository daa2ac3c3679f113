"""Prefect and MLflow servers with authentication on PostgreSQL, as docs/production.md has it.

All servers are the real programs: a PostgreSQL (password login over TCP) holding Prefect's
database, MLflow's tracking store and MLflow's user store; Prefect with an API auth string
(HTTP basic); MLflow with its basic-auth app (an admin, a service user for pipelines).
Requests without credentials or with wrong ones are refused with 401, and a whole
`trainflow run` in a separate process (its training ranks are processes of their own) logs to
both with credentials taken from the environment only.

PostgreSQL comes from Debian's package, installed when missing (as root, with apt). Where it
cannot be had, the servers run on SQLite instead (fail in CI, where PostgreSQL is required).
"""

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from mlflow.tracking import MlflowClient

from tests.postgres import postgres
from tests.services import (
    get_json,
    http_status,
    mlflow_server,
    post,
    prefect_server,
    service_env,
)

pytestmark = pytest.mark.integration

PREFECT_AUTH = "trainflow:prefect-secret-8d2f"
ADMIN = ("admin", "admin-secret-71c0")
PIPELINE_USER = ("pipeline", "pipeline-secret-5a9e")
# MLflow's basic-auth app as docs/production.md configures it: a user store and an admin
# created on first start. Every user may read everything and manages what they create (with
# NO_PERMISSIONS the registry's existence check of a new model answers 403 instead of 404).
# Checked credentials are cached for 60 s: without it every request hashes the password with
# scrypt (~0.1 CPU s), and the tiny pipeline cost the server 42 CPU s.
AUTH_INI = """[mlflow]
default_permission = READ
database_uri = {database_uri}
admin_username = {admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 60
"""


def basic(user: str, password: str) -> dict[str, str]:
    """An HTTP basic Authorization header."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@dataclass(frozen=True)
class Databases:
    """SQLAlchemy URLs of the three databases the servers use."""

    kind: str  # "postgresql" or "sqlite"
    prefect: str
    mlflow: str
    mlflow_auth: str


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Databases]:
    """PostgreSQL databases for both servers; SQLite files where PostgreSQL cannot run."""
    with postgres() as server:
        if server is None:
            if os.environ.get("CI"):
                pytest.fail("no PostgreSQL in CI: `apt-get install postgresql` failed")
            folder = tmp_path_factory.mktemp("sqlite")
            yield Databases(
                "sqlite",
                f"sqlite+aiosqlite:///{folder}/prefect.db",
                f"sqlite:///{folder}/mlflow.db",
                f"sqlite:///{folder}/basic_auth.db",
            )
            return
        with psycopg.connect(f"postgresql://{server}/postgres", autocommit=True) as conn:
            for name in ("prefect", "mlflow", "mlflow_auth"):
                conn.execute(f"CREATE DATABASE {name}")
        yield Databases(
            "postgresql",
            f"postgresql+asyncpg://{server}/prefect",
            f"postgresql+psycopg://{server}/mlflow",
            f"postgresql+psycopg://{server}/mlflow_auth",
        )


def sql_rows(database: str, sql: str, *args: str) -> list[tuple[Any, ...]]:
    """Rows of one SQL query on a PostgreSQL database given by its SQLAlchemy URL."""
    url = "postgresql://" + database.split("://", 1)[1]
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()


@dataclass(frozen=True)
class Servers:
    """An authenticated Prefect server (its API URL), an MLflow one, and their databases."""

    prefect_api: str
    mlflow: str
    db: Databases


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, databases: Databases) -> Iterator[Servers]:
    folder = tmp_path_factory.mktemp("auth")
    ini = folder / "basic_auth.ini"
    ini.write_text(AUTH_INI.format(database_uri=databases.mlflow_auth, admin=ADMIN[0]))
    mlflow_env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(ini),
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only-csrf-key-3b1e9f",
    }
    mlflow_args = ["--app-name", "basic-auth", "--backend-store-uri", databases.mlflow]
    prefect_env = {
        "PREFECT_SERVER_API_AUTH_STRING": PREFECT_AUTH,
        "PREFECT_API_DATABASE_CONNECTION_URL": databases.prefect,
    }
    with (
        prefect_server(folder / "prefect", env=prefect_env) as api,
        mlflow_server(folder / "mlflow", mlflow_args, env=mlflow_env) as url,
    ):
        created = post(
            f"{url}/api/2.0/mlflow/users/create",
            {"username": PIPELINE_USER[0], "password": PIPELINE_USER[1]},
            basic(*ADMIN),
        )
        assert isinstance(created, dict), f"creating the pipeline user failed: HTTP {created}"
        yield Servers(api, url, databases)


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
    argv = [sys.executable, "-m", "trainflow.flows.cli", "run", "--preset", "tiny"]
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
    if servers.db.kind == "postgresql":  # the records are in PostgreSQL itself
        parent_id = runs["tiny"].info.run_id
        sql = "SELECT status FROM runs WHERE run_uuid = %s"
        assert sql_rows(servers.db.mlflow, sql, parent_id) == [("FINISHED",)]
        sql = "SELECT state_type FROM flow_run WHERE id = %s"
        assert sql_rows(servers.db.prefect, sql, flow_run["id"]) == [("COMPLETED",)]
        sql = "SELECT is_admin FROM users WHERE username = %s"
        assert sql_rows(servers.db.mlflow_auth, sql, PIPELINE_USER[0]) == [(False,)]


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
    assert code == 2
    assert "401" in output and "not authenticated" in output, output[-3000:]
    assert "refused the request" in output and "MLFLOW_TRACKING_PASSWORD" in output
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
    assert code == 2
    assert "401" in output and "PREFECT_API_AUTH_STRING" in output, output[-3000:]
    assert _flow_runs(servers, no_prefect) == []
    assert admin_client.get_experiment_by_name(no_prefect.name) is None


CHECK_BOTH = """
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

MlflowClient({mlflow!r}).search_experiments()
with get_client(sync_client=True) as client:
    client.read_flow_runs(limit=1)
print("both answered")
"""


def test_credentials_can_come_from_private_files_in_home(servers: Servers, tmp_path: Path) -> None:
    """MLflow reads ~/.mlflow/credentials, Prefect its profile: no secret in the environment."""
    home = tmp_path / "home"
    (home / ".mlflow").mkdir(parents=True)
    (home / ".prefect").mkdir()
    env = service_env(HOME=str(home), PREFECT_HOME=str(home / ".prefect"))
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILES_PATH"):
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_TRACKING_")}
    argv = [sys.executable, "-c", CHECK_BOTH.format(mlflow=servers.mlflow)]

    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr[-2000:]

    credentials = home / ".mlflow" / "credentials"
    credentials.write_text(
        f"[mlflow]\nmlflow_tracking_username = {PIPELINE_USER[0]}\n"
        f"mlflow_tracking_password = {PIPELINE_USER[1]}\n"
    )
    profiles = home / ".prefect" / "profiles.toml"
    profiles.write_text(
        f'active = "production"\n\n[profiles.production]\n'
        f'PREFECT_API_URL = "{servers.prefect_api}"\n'
        f'PREFECT_API_AUTH_STRING = "{PREFECT_AUTH}"\n'
    )
    for secret in (credentials, profiles):
        secret.chmod(0o600)
    answered = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert "both answered" in answered.stdout
