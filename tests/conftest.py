"""Shared test settings: no Prefect telemetry, no stray MLflow store in the working folder."""

import os
import signal
import tempfile
from pathlib import Path

import pytest

pytest_plugins = ["tests.cpu_report"]

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

# Under pytest-xdist (make test runs two workers) each worker's `trainflow run`s get a Prefect
# home of their own: two temporary Prefect servers migrating one SQLite file at once can fail.
if "PYTEST_XDIST_WORKER" in os.environ and "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(
        prefix=f"trainflow-tests-prefect-{os.environ['PYTEST_XDIST_WORKER']}-"
    )

# Run from a background shell (`make test &`, nohup, some CI runners) this process starts with
# SIGINT ignored, and every local job controller the tests start would inherit that and ignore
# the SIGINT that cancels it. What a terminal gives: Ctrl-C raises KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """xdist groups for `pytest -n 2 --dist loadgroup` (make test): a test file's tests stay on
    one worker (module fixtures such as servers start once), and every test under tests/slurm
    runs on one worker, one after another, since they share the dev cluster's few CPUs."""
    slurm = Path(__file__).parent / "slurm"
    for item in items:
        group = "slurm" if item.path.is_relative_to(slurm) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
