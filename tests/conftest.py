"""Shared test settings: no Prefect telemetry, no stray MLflow store in the working folder;
one real Prefect server for the whole run, for the tests that need it (under pytest-xdist the
controller starts it and every worker talks to it)."""

import atexit
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import cgroups

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

# Under pytest-xdist (make test runs several workers) each worker's `trainflow run`s get a Prefect
# home of their own: two temporary Prefect servers migrating one SQLite file at once can fail.
WORKER_HOME: Path | None = None
"""That Prefect home, where this process made one."""
if "PYTEST_XDIST_WORKER" in os.environ and "PREFECT_HOME" not in os.environ:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(
        prefix=f"trainflow-tests-prefect-{os.environ['PYTEST_XDIST_WORKER']}-"
    )
    WORKER_HOME = Path(os.environ["PREFECT_HOME"])
    atexit.register(shutil.rmtree, WORKER_HOME, ignore_errors=True)  # none left in /tmp

# Run from a background shell (`make test &`, nohup, some CI runners) this process starts with
# SIGINT ignored, and every local job controller the tests start would inherit that and ignore
# the SIGINT that cancels it. What a terminal gives: Ctrl-C raises KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


GROUP_SECONDS = Path(__file__).with_name("group_seconds.json")
"""Rough seconds per test file, for ordering only (a wrong or missing entry costs at most some
idle time at the end of a parallel run; refresh it from `pytest --durations=0` when files move)."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """xdist groups for `pytest -n N --dist loadgroup` (make test): a test file's tests stay on
    one worker (module fixtures such as servers start once; a Slurm test file uses its worker's
    own dev cluster, tests/slurm/conftest.py). Files are ordered longest first by
    GROUP_SECONDS (files it does not know, new ones, after them in collection order), so that
    with --no-loadscope-reorder no long file starts last and holds the run's end alone."""
    seconds = json.loads(GROUP_SECONDS.read_text()) if GROUP_SECONDS.exists() else {}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(_group(item), 0.0), order[id(item)]))


def _group(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


QUIET_SERVER = {
    f"PREFECT_SERVER_SERVICES_{service}_ENABLED": "false"
    for service in (
        *("LATE_RUNS", "PAUSE_EXPIRATIONS", "SCHEDULER", "FOREMAN", "REPOSSESSOR"),
        *("CLEANUP_RECONCILER", "TRIGGERS"),
    )
}
"""The test server's loops that no test uses (schedules, late runs, pauses, worker health,
automations) are off: idle, it then takes 0.7 instead of 1.3 CPU seconds a minute (measured);
cancellation, events and task-run recording stay on."""


SHARED_PREFECT_API = "TRAINFLOW_TESTS_PREFECT_API"
"""Set by the pytest-xdist controller for its workers: the API URL of the run's one Prefect
server (see `pytest_configure`)."""
SHARED_PREFECT_LOG = "TRAINFLOW_TESTS_PREFECT_LOG"
"""Likewise: that server's log (the workers wait for it to answer; its tail if it never does)."""

_CONTROLLER_SERVICES = contextlib.ExitStack()
"""What the xdist controller started for its workers, stopped by `pytest_unconfigure`."""


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N` (make test) the controller starts the run's one Prefect server
    before its workers start, and they inherit where to find it (SHARED_PREFECT_API): one
    server's start and idle loops instead of one per worker. Run alone (no -n), a test process
    starts its own in `prefect_api`. The server is not waited for here: each worker waits
    where it first needs it."""
    from tests.services import prefect_server

    controller = not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
    if not controller or SHARED_PREFECT_API in os.environ:
        return
    folder = Path(tempfile.mkdtemp(prefix="trainflow-tests-prefect-server-"))
    _CONTROLLER_SERVICES.callback(shutil.rmtree, folder, ignore_errors=True)
    server = prefect_server(folder, env=QUIET_SERVER, wait=False)
    os.environ[SHARED_PREFECT_API] = _CONTROLLER_SERVICES.enter_context(server)
    os.environ[SHARED_PREFECT_LOG] = str(folder / "prefect-server.log")


def pytest_unconfigure(config: pytest.Config) -> None:
    _CONTROLLER_SERVICES.close()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real `prefect server start` for the run (the xdist controller's, shared by its
    workers; else this test process's own), as a user's running server or the local stack's:
    its API URL, also set in this process's settings and in os.environ, so flows run here and
    every `trainflow run` or served flow a test starts talk to it instead of each booting a
    temporary server of its own. Tests tell their runs apart by ids (and served deployments by
    names of their own), never by counting all flow runs. Requested by every test under
    tests/integration and tests/slurm (their conftest.py)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.services import http_status, prefect_server, wait_for

    previous = os.environ.get("PREFECT_API_URL")
    with contextlib.ExitStack() as stack:
        if SHARED_PREFECT_API in os.environ:
            api = os.environ[SHARED_PREFECT_API]
            try:
                wait_for(lambda: http_status(f"{api}/health") == 200, 180, "the Prefect server")
            except AssertionError:
                log = Path(os.environ.get(SHARED_PREFECT_LOG, "/nonexistent"))
                tail = log.read_text()[-3000:] if log.exists() else "(no log)"
                raise AssertionError(f"the run's Prefect server {api} is down:\n{tail}") from None
        else:
            folder = tmp_path_factory.mktemp("prefect-server")
            api = stack.enter_context(prefect_server(folder, env=QUIET_SERVER))
        os.environ["PREFECT_API_URL"] = api
        try:
            with temporary_settings({PREFECT_API_URL: api}):
                yield api
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous


@pytest.fixture
def memory_groups() -> Iterator[Callable[[int], Path]]:
    """Makes memory cgroups limited to a given number of bytes, removed after the test
    (tests.cgroups.memory_groups; skips where no cgroup v1 memory group can be made)."""
    with cgroups.memory_groups() as make:
        yield make
