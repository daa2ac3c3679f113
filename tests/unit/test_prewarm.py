"""Background imports (ranks, the flow while it waits) and the early temporary Prefect server."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.services import http_status
from tests.unit.held_fork_driver import SEED_ENV
from trainflow.flows.early_server import (
    api_url_in_use,
    keep_if_needed,
    start_temporary_server,
)
from trainflow.tasks.prewarm import EVALUATE_MODULES, prewarm_imports
from trainflow.tasks.train.warmup import DYNAMO, prewarm_rank


def test_prewarm_imports_modules_on_a_thread() -> None:
    name = "tests.unit.datasets"
    sys.modules.pop(name, None)
    thread = prewarm_imports((name,))
    thread.join(timeout=120)
    assert not thread.is_alive() and thread.daemon
    assert name in sys.modules


def test_a_failing_prewarm_import_is_left_to_the_main_thread() -> None:
    thread = prewarm_imports(("no_such_module_here", "tests.unit.datasets"))
    thread.join(timeout=120)
    assert "no_such_module_here" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        __import__("no_such_module_here")


def test_a_rank_prewarms_dynamo_only() -> None:
    thread = prewarm_rank()
    thread.join(timeout=300)
    assert DYNAMO in sys.modules


def test_evaluate_modules_import() -> None:
    thread = prewarm_imports(EVALUATE_MODULES)
    thread.join(timeout=300)
    assert all(name in sys.modules for name in EVALUATE_MODULES)


def test_no_early_server_when_the_environment_names_a_prefect_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert start_temporary_server() is None  # nothing was started
    assert "prefect-temporary-server" not in {t.name for t in threading.enumerate()}


def test_the_early_server_answers_in_its_own_process_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, migrated_prefect: Path
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    shutil.copyfile(migrated_prefect, tmp_path / "p.db")  # no migration to wait for
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv(
        "PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{tmp_path}/p.db"
    )
    app_loaded = "prefect.server.api.server" in sys.modules  # (by another test, maybe)
    server = start_temporary_server()
    assert server is not None
    # Restored to its default (none), even where this test process runs a server for others.
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert keep_if_needed(server) is server  # no API configured: it is needed
        with api_url_in_use(server):
            assert PREFECT_API_URL.value() == server.api_url
    assert ("prefect.server.api.server" in sys.modules) == app_loaded  # not imported here
    assert http_status(f"{server.api_url}/health") == 200
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert keep_if_needed(server) is None  # a profile names an API after all: stopped
    assert http_status(f"{server.api_url}/health") is None


def test_the_database_store_is_preloaded_only_for_database_uris() -> None:
    from trainflow.flows.early_server import preload_tracking_store

    name = "mlflow.store.tracking.sqlalchemy_store"
    if name not in sys.modules:  # an earlier test may have needed it already
        preload_tracking_store("http://127.0.0.1:5000")
        assert name not in sys.modules
    preload_tracking_store("sqlite:////tmp/x.db")
    assert name in sys.modules


def test_a_held_server_serves_once_released_and_an_unreleased_one_never_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, migrated_prefect: Path
) -> None:
    """flows.held_server: imported beside the model check, serving only once released (a
    refused model ends it: no Prefect server ever listened)."""
    import psutil

    from trainflow.flows.early_server import _let_go, hold_temporary_server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv(
        "PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{tmp_path}/p.db"
    )
    refused = hold_temporary_server(fork=False)  # the fork: the next test
    assert refused is not None
    time.sleep(1)
    assert psutil.Process(refused.pid).net_connections(kind="inet") == []  # held: no port
    _let_go(refused)  # what the command's exit does when the model was refused
    assert refused.returncode is not None and not (tmp_path / "p.db").exists()

    shutil.copyfile(migrated_prefect, tmp_path / "p.db")  # no migration to wait for
    held = hold_temporary_server(fork=False)
    server = start_temporary_server(held)
    assert server is not None and held is not None
    try:
        url = server.wait()
        assert http_status(f"{url}/health") == 200
        assert psutil.Process(held.pid).net_connections(kind="inet")  # the held process serves
    finally:
        server.stop(quiet=True)
    assert http_status(f"{url}/health") is None


def test_a_held_server_forked_from_the_command_shares_its_prefect_and_none_of_its_pipes(
    tmp_path: Path, migrated_prefect: Path
) -> None:
    """What `trainflow run` does once it has imported Prefect (tests/unit/held_fork_driver.py,
    a process of its own: a fork of pytest would copy its threads): the held server is a fork,
    holds no pipe of the command's (the warm-rank server ends when its stdin pipe closes),
    never listens while held, and serves once released."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path)
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{tmp_path}/p.db"
    env[SEED_ENV] = str(migrated_prefect)  # copied in once the refusal is checked
    argv = [sys.executable, "-m", "tests.unit.held_fork_driver"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["forked"] and report["parent"] == report["pid_of_command"]
    assert report["pipe_held_by_fork"] is False
    assert report["held_listens"] == [] and report["refused_ended"]
    assert not report["db_after_refusal"]
    assert report["health"] == 200 and report["released_listens"]
    assert report["health_after_stop"] is None


def test_a_forked_temporary_server_ends_when_its_command_is_killed(
    tmp_path: Path, migrated_prefect: Path
) -> None:
    """SIGKILL to the command (no atexit runs): its forked Prefect server gets SIGTERM from the
    kernel (PDEATHSIG) and ends; no server outlives the run."""
    import psutil

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path)
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{tmp_path}/p.db"
    shutil.copyfile(migrated_prefect, tmp_path / "p.db")  # no migration to wait for
    argv = [sys.executable, "-m", "tests.unit.held_fork_driver", "--orphaned"]
    command = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    server: psutil.Process | None = None
    try:
        assert command.stdout is not None
        server = psutil.Process(json.loads(command.stdout.readline())["server"])
        assert server.ppid() == command.pid and server.is_running()
        command.kill()
        command.wait()
        server.wait(timeout=30)  # raises TimeoutExpired if it outlived its command
    finally:
        command.kill()
        if server is not None and server.is_running():
            server.kill()
