"""Start Prefect's temporary server early, so it boots while the flow process imports.

Without `PREFECT_API_URL` a flow starts Prefect's temporary server on its first API call: after
this process has imported torch, MLflow and the pipeline (several seconds), and then it waits
another 10-15 s for the server to answer. Started here first, the server boots in its own
process on another core while this one imports; the flow's call then finds it running (Prefect
keeps one such server per process) and stops it at exit as before.
"""

import importlib
import threading
from collections.abc import Callable

OVERLAP_ALLOWANCE_S = 60
"""Added to Prefect's start-up timeout (20 s by default): the server now boots while this
process imports, and on a busy machine the two share the cores (seen: a 2-core machine at
load 11 timed out at 20 s)."""


def start_temporary_server() -> Callable[[], None]:
    """Begin starting Prefect's temporary server when no Prefect API is configured.

    Returns a function that waits until the server answers (and re-raises its start-up
    error); it returns at once when a server is configured or ephemeral mode is off.
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return lambda: None
    errors: list[BaseException] = []
    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() + OVERLAP_ALLOWANCE_S

    def start() -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start(timeout=timeout)
        except BaseException as err:  # handed to the caller of wait()
            errors.append(err)

    thread = threading.Thread(target=start, name="prefect-temporary-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if errors:
            raise errors[0]

    return wait


_DB_SCHEMES = ("sqlite:", "postgresql", "mysql", "mssql")


def preload_tracking_store(tracking_uri: str) -> None:
    """Import MLflow's database store when the runs go to a database (SQLite by default).

    The first MlflowClient on such a URI imports it (SQLAlchemy models, alembic): ~2 s on
    2 idle cores, the bulk of the flow's run set-up. Called while the temporary server boots,
    that import leaves the critical path; against a running server it only moves earlier.
    """
    if tracking_uri.startswith(_DB_SCHEMES):
        importlib.import_module("mlflow.store.tracking.sqlalchemy_store")
