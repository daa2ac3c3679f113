"""Start Prefect's temporary server early, in its own process, so it boots while the flow
process imports.

Without `PREFECT_API_URL` a flow starts Prefect's temporary server on its first API call: after
this process has imported torch, MLflow and the pipeline (several seconds), and then it waits
another 10-15 s for the server to answer. Prefect's own starter (SubprocessASGIServer) lives in
`prefect.server.api.server`, which imports the whole server application (FastAPI routes,
database models, docket: ~2.5 s of CPU alone, 7 s at load 6 on 2 cores) into the flow process
only to start a subprocess that imports it all again. So the same subprocess is started here
from its command line (uvicorn on Prefect's app factory, UI off, the temporary server's flags),
which needs only `prefect.settings`; the flow then runs against it as against a running server
(`api_url_in_use`), and it stops at exit as Prefect's own temporary server does.
"""

import atexit
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeAlias

from trainflow.cluster.warm_pool import ForkedServer
from trainflow.flows.held_server import SERVER_ENV, fork_held

Held: TypeAlias = "subprocess.Popen[bytes] | ForkedServer"
"""Prefect's temporary server held by this process: a fork of it, or a process of its own."""

OVERLAP_ALLOWANCE_S = 60
"""Added to Prefect's start-up timeout (20 s by default): the server boots while this process
imports, and on a busy machine the two share the cores (seen: a 2-core machine at load 11
timed out at 20 s)."""

PORT_IN_USE_EXIT = 3
"""uvicorn's exit code when its port was taken meanwhile (then another port is tried)."""


class TemporaryServer:
    """Prefect's temporary server started in a subprocess; `wait()` gives its API URL."""

    def __init__(self, timeout_s: float, held: "Held | None" = None) -> None:
        self._timeout_s = timeout_s
        self._held = held
        self._errors: list[BaseException] = []
        self._proc: Held | None = None
        self.api_url: str | None = None
        self._thread = threading.Thread(target=self._start, name="prefect-temporary-server")
        self._thread.daemon = True
        self._thread.start()

    def _start(self) -> None:
        try:
            deadline = time.monotonic() + self._timeout_s
            while True:
                port = _free_port()
                self._proc = _release(self._held, port) if self._held else _uvicorn(port)
                self._held = None
                code = _wait_healthy(self._proc, f"http://127.0.0.1:{port}/api/health", deadline)
                if code != PORT_IN_USE_EXIT:
                    break
            if code is not None:
                raise RuntimeError(f"Prefect's temporary server exited with code {code}")
            self.api_url = f"http://127.0.0.1:{port}/api"
        except BaseException as err:  # handed to the caller of wait()
            self._errors.append(err)

    def wait(self) -> str:
        """The server's API URL once it answers; re-raises its start-up error."""
        self._thread.join()
        if self._errors:
            raise self._errors[0]
        assert self.api_url is not None
        return self.api_url

    def stop(self, quiet: bool = False) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s), as Prefect's own does; it
        says so unless `quiet` or the server never answered (a run refused before it used it)."""
        self._thread.join(timeout=1)
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if not quiet and self.api_url is not None:
            print(
                f"trainflow: stopping Prefect's temporary server ({self.api_url})", file=sys.stderr
            )
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hold_temporary_server(fork: bool = True) -> "Held | None":
    """Where the temporary server will be wanted, start it held (flows.held_server): it
    imports Prefect's server application beside the model check and starts serving only once
    start_temporary_server hands it a port; at this process's exit, unused, it just ends.
    A fork of this process where Prefect is imported here (the fork shares it: ~1 CPU s less
    than a process of its own), else (or `fork=False`) a process of its own."""
    if not temporary_server_wanted():
        return None
    held: Held | None = None
    if fork and "prefect" in sys.modules:
        held = fork_held()
    if held is None:
        argv = [sys.executable, "-m", "trainflow.flows.held_server"]
        held = subprocess.Popen(argv, env=_server_env(), stdin=subprocess.PIPE)
    atexit.register(_let_go, held)
    return held


def _let_go(held: "Held") -> None:
    """End a held server that was never released (a refused model, an interrupted command);
    a released one is the temporary server, stopped as such."""
    if not getattr(held, "released", False) and held.poll() is None:
        held.kill()
        held.wait()


def _release(held: "Held", port: int) -> "Held":
    """The held server, told to serve on `port`; a fresh one where it has ended meanwhile."""
    try:
        assert held.stdin is not None
        held.stdin.write(f"{port}\n".encode())
        held.stdin.close()
    except (OSError, ValueError):
        return _uvicorn(port)
    held.released = True  # type: ignore[union-attr]
    return held


def _server_env() -> dict[str, str]:
    return {"PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # as the flow process sets it
            **os.environ, **SERVER_ENV}  # fmt: skip


def _uvicorn(port: int) -> "subprocess.Popen[bytes]":
    """Prefect's temporary server process, as SubprocessASGIServer starts it (Prefect 3).

    Prefect adds this process's settings to the server's environment; the server reads the
    same sources itself (environment, profile, .env and pyproject.toml in the same folder),
    and nothing here sets one in code, so the environment is passed as it is.
    """
    import importlib.util

    spec = importlib.util.find_spec("prefect")  # its folder, without importing Prefect
    assert spec is not None and spec.origin is not None
    app_dir = os.path.dirname(os.path.dirname(spec.origin))
    env = _server_env()
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", app_dir,
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "error", "--lifespan", "on"]  # fmt: skip
    return subprocess.Popen(argv, env=env)


def _wait_healthy(proc: "Held", url: str, deadline: float) -> int | None:
    """None once `url` answers 200; the exit code if the process ends first; or time out."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(
        "timed out waiting for Prefect's temporary server: start one (`prefect server start`) "
        "and set PREFECT_API_URL, or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
    )


def temporary_server_wanted() -> bool:
    """Whether the environment leaves Prefect to start its temporary server (no API named,
    the temporary server not turned off); a profile may still name one (keep_if_needed)."""
    if os.environ.get("PREFECT_API_URL"):
        return False
    return os.environ.get("PREFECT_SERVER_EPHEMERAL_ENABLED", "").lower() not in ("0", "false")


def start_temporary_server(
    held: "Held | None" = None,
) -> TemporaryServer | None:
    """Begin starting Prefect's temporary server unless the environment names a Prefect API
    or turns the temporary server off; it is stopped at this process's exit.

    Called before Prefect is imported (its settings alone take ~1-2.5 s to import): a profile
    may still configure an API, which `keep_if_needed` checks once they are imported.
    """
    if not temporary_server_wanted():
        return None
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 20))
    server = TemporaryServer(timeout + OVERLAP_ALLOWANCE_S, held)
    atexit.register(server.stop)
    return server


def keep_if_needed(server: TemporaryServer | None) -> TemporaryServer | None:
    """`server`, or None (stopped) where Prefect's settings configure an API after all or
    leave the temporary server off (a profile, a .env file)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if server is not None and (
        PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value()
    ):
        server.stop()
        return None
    return server


@contextmanager
def api_url_in_use(server: TemporaryServer | None) -> Iterator[Any]:
    """Prefect's settings pointing at `server` inside the block (nothing when None)."""
    if server is None:
        with nullcontext():
            yield
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.wait()}):
        yield


_DB_SCHEMES = ("sqlite:", "postgresql", "mysql", "mssql")


def preload_tracking_store(tracking_uri: str) -> None:
    """Import MLflow's database store when the runs go to a database (SQLite by default).

    The first MlflowClient on such a URI imports it (SQLAlchemy models, alembic): ~2 s on
    2 idle cores, the bulk of the flow's run set-up. Called while the temporary server boots,
    that import leaves the critical path; against a running server it only moves earlier.
    """
    if tracking_uri.startswith(_DB_SCHEMES):
        importlib.import_module("mlflow.store.tracking.sqlalchemy_store")
