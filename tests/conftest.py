"""Shared test settings: no Prefect telemetry, no stray MLflow store in the working folder;
one real Prefect server and one warm command service for the whole run, for the tests that
need them (under pytest-xdist the controller starts them and every worker talks to them)."""

import atexit
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.cpu_report"]

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


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """Collection imports every test module (torch, Prefect, MLflow, the pipeline) with the
    garbage collector paused: 15-25% less CPU for those imports (tasks.import_gc), then
    frozen: no later collection of this process traverses them (pytest's exit alone runs five
    full collections: `pytest --collect-only` 11.9 -> 6.0 CPU s, measured)."""
    from trainflow.tasks.import_gc import freeze_imported, imports_without_gc

    with imports_without_gc():
        result = yield
        freeze_imported()
    return result


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """xdist groups for `pytest -n N --dist loadgroup` (make test): a test file's tests stay on
    one worker (module fixtures such as servers start once; a Slurm test file uses its worker's
    own dev cluster, tests/slurm/conftest.py). Files are ordered longest first by
    GROUP_SECONDS (files it does not know, new ones, after them in collection order), so that
    with --no-loadscope-reorder no long file starts last and holds the run's end alone."""
    from tests.cpu_report import GROUP_SECONDS  # a plugin: imported by pytest first

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
SHARED_WARM_SOCKET = "TRAINFLOW_TESTS_WARM_SOCKET"
"""Likewise: the socket of the run's one warm command service (its log beside it)."""

_CONTROLLER_SERVICES = contextlib.ExitStack()
"""What the xdist controller started for its workers, stopped by `pytest_unconfigure`."""


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N` (make test) the controller starts the run's one Prefect server and
    one warm command service before its workers start, and they inherit where to find them
    (SHARED_PREFECT_API, SHARED_WARM_SOCKET): one server's start and idle loops (~4 CPU s, then
    ~0.9 a minute: measured) and one service's imports (~6 CPU s) instead of one each per
    worker. The requests they answer are the same either way. Run alone (no -n), a test
    process starts its own in `prefect_api` and `warm_command`. The service is not waited for
    here: a worker's first served command waits until it serves."""
    from tests.services import (
        background,
        migrated_prefect_db,
        prefect_server,
        save_template,
        service_env,
    )

    controller = not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
    if not controller or SHARED_PREFECT_API in os.environ:
        return
    folder = Path(tempfile.mkdtemp(prefix="trainflow-tests-prefect-server-"))
    _CONTROLLER_SERVICES.callback(shutil.rmtree, folder, ignore_errors=True)
    shared = _template_dir(folder)
    with migrated_prefect_db(shared, folder) as seeded:
        # On a seeded database the workers start (and collect) while the server boots (~5 s
        # on one core); each waits for it where it first needs it (`prefect_api`).
        server = prefect_server(folder, env=QUIET_SERVER, wait=not seeded)
        api = _CONTROLLER_SERVICES.enter_context(server)
        if not seeded:
            save_template(shared, folder)
    os.environ[SHARED_PREFECT_API] = api
    os.environ[SHARED_PREFECT_LOG] = str(folder / "prefect-server.log")
    warm = folder / "warm-command"
    warm.mkdir(mode=0o700)  # as the service demands
    argv = [
        sys.executable,
        "-m",
        "trainflow.flows.cli",
        "warm",
        "--socket",
        str(warm / "warm.sock"),
    ]
    env = service_env(PREFECT_API_URL=api)
    _CONTROLLER_SERVICES.enter_context(background(argv, warm / "warm.log", env))
    os.environ[SHARED_WARM_SOCKET] = str(warm / "warm.sock")


def pytest_unconfigure(config: pytest.Config) -> None:
    _CONTROLLER_SERVICES.close()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real `prefect server start` for the run (the xdist controller's, shared by its
    workers; else this test process's own), as a user's running server or the local stack's:
    its API URL, also set in this process's settings and in os.environ, so flows run here and
    every `trainflow run` or served flow a test starts talk to it instead of each booting a
    temporary server of its own (about 8 CPU seconds apiece). Tests tell their runs apart by
    ids (and served deployments by names of their own), never by counting all flow runs.
    Requested by every test under tests/integration and tests/slurm (their conftest.py)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.services import (
        http_status,
        migrated_prefect_db,
        prefect_server,
        save_template,
        wait_for,
    )

    previous = os.environ.get("PREFECT_API_URL")
    shared = _template_dir(tmp_path_factory.getbasetemp())
    with contextlib.ExitStack() as stack:
        if SHARED_PREFECT_API in os.environ:
            api = os.environ[SHARED_PREFECT_API]
            try:
                wait_for(lambda: http_status(f"{api}/health") == 200, 120, "the Prefect server")
            except AssertionError:
                log = Path(os.environ.get(SHARED_PREFECT_LOG, "/nonexistent"))
                tail = log.read_text()[-3000:] if log.exists() else "(no log)"
                raise AssertionError(f"the run's Prefect server {api} is down:\n{tail}") from None
        else:
            # A database at Prefect's head revision: a machine's first server migrates one,
            # later ones (and this worker's temporary servers, WORKER_HOME) start from a copy.
            folder = tmp_path_factory.mktemp("prefect-server")
            with migrated_prefect_db(shared, folder) as seeded:
                api = stack.enter_context(prefect_server(folder, env=QUIET_SERVER))
                if not seeded:
                    save_template(shared, folder)
        if WORKER_HOME is not None:
            with migrated_prefect_db(shared, WORKER_HOME):
                pass
        os.environ["PREFECT_API_URL"] = api
        try:
            with temporary_settings({PREFECT_API_URL: api}):
                yield api
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous


@pytest.fixture(scope="session")
def migrated_prefect(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Prefect SQLite database at Prefect's head revision, for a test to copy where its
    server need not migrate a new one (made by a real server of this run: the first that
    needed one, or here)."""
    from tests.services import migrated_prefect_db, prefect_server, save_template

    shared = _template_dir(tmp_path_factory.getbasetemp())
    folder = tmp_path_factory.mktemp("prefect-template")
    with migrated_prefect_db(shared, folder) as seeded:
        if not seeded:
            with prefect_server(folder, env=QUIET_SERVER):
                save_template(shared, folder)
    return folder / "prefect.db"


@pytest.fixture(scope="session")
def warm_command(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One real `trainflow warm` for the run (the xdist controller's, shared by its workers;
    else this test process's own), as `deploy/stack.sh up` runs one beside the Prefect server;
    its socket (see `served_commands`)."""
    from tests.services import background, service_env, wait_for

    if SHARED_WARM_SOCKET in os.environ:  # the xdist controller's (pytest_configure)
        sock = Path(os.environ[SHARED_WARM_SOCKET])
        log = sock.with_name("warm.log")
        wait_for(lambda: "serving on" in log.read_text(), 180, f"trainflow warm to serve ({log})")
        yield sock
        return
    folder = tmp_path_factory.mktemp("warm-command")  # 0700, as the service demands
    sock, log = folder / "warm.sock", folder / "warm.log"
    argv = [sys.executable, "-m", "trainflow.flows.cli", "warm", "--socket", str(sock)]
    with background(argv, log, service_env(PREFECT_API_URL=prefect_api)):
        wait_for(lambda: "serving on" in log.read_text(), 180, "trainflow warm to serve")
        yield sock


@pytest.fixture
def served_commands(warm_command: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TRAINFLOW_WARM_SOCKET set for this test: every `trainflow run` it starts with this
    process's environment runs as a fork of the warm service with its imports done (a tiny run:
    ~6 instead of ~15 CPU s, measured), exactly as a user's command with the stack up does.
    Requested by every test under tests/integration and tests/slurm; a test about the cold
    command itself requests `cold_command`."""
    from trainflow.flows.warm_command import SOCKET_ENV

    monkeypatch.setenv(SOCKET_ENV, str(warm_command))
    return warm_command


@pytest.fixture
def cold_command(served_commands: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's `trainflow` commands run cold (a fresh process each, no warm service), as
    they do for a user without the stack: for tests of the command itself (its signals, its
    terminal output, a Slurm job's own command)."""
    from trainflow.flows.warm_command import SOCKET_ENV

    monkeypatch.delenv(SOCKET_ENV)


def _template_dir(fallback: Path) -> Path:
    """Where the migrated Prefect database template is kept: the machine's trainflow cache
    (tasks.cache_dir), as the MLflow store template is, so that only the first run on a
    machine (per Prefect version) migrates one; where the cache cannot be written, the folder
    above `fallback` (this run's base folder, which every xdist worker shares) for a worker,
    `fallback` itself otherwise."""
    from trainflow.tasks.cache_dir import cache_root

    folder = cache_root() / "prefect-dbs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return fallback.parent if "PYTEST_XDIST_WORKER" in os.environ else fallback
