"""Real services for tests: free loopback ports, polling, Prefect and MLflow servers.

Every server here is the real program, started as a subprocess in its own session on a free
loopback port with its state under a test folder, and stopped with SIGINT (a Prefect server
or worker ignores SIGTERM for 25+ s).
"""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral
    range: a port the kernel hands out (bind to 0) is also the source port of any outgoing
    connection, and with four test workers talking to servers one of those took a port between
    this check and a server's bind (seen: a Prefect server exiting 'address already in use')."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port found between 10000 and {low}")


def in_squeue(job_id: str) -> bool:
    """Whether the (dev) Slurm cluster still lists the job (pending, running or completing)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return bool(out.stdout.strip())


def wait_for(predicate: Callable[[], T | None], limit_s: float, what: str) -> T:
    """Poll `predicate` every 0.5 s until it returns something truthy; fail after limit_s."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {limit_s} s waiting for {what}")


def wait_for_line(proc: subprocess.Popen[str], needle: str, limit_s: float) -> list[str]:
    """Read `proc`'s stdout until a line contains `needle`; the lines read. AssertionError with
    the last lines if it does not appear within `limit_s` or the process ends first."""
    lines: list[str] = []
    deadline = time.monotonic() + limit_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} never appeared:\n{''.join(lines[-30:])}")


def http_status(url: str, headers: Mapping[str, str] | None = None) -> int | None:
    """The HTTP status of a GET (errors included), or None when nothing answers."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return None


def get_json(url: str, headers: Mapping[str, str] | None = None) -> Any:
    """The JSON body of a successful GET, or None."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.load(resp)
    except OSError:
        return None


# Answers a client should retry, as Prefect's own client does: a Prefect server answers 503 when
# its database is busy (SQLite "database is locked" under four test workers; seen in CI).
RETRY_CODES = frozenset({429, 502, 503})


def post(
    url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None, limit_s: float = 60
) -> Any:
    """POST JSON; the decoded answer, or the HTTP status when it is an error. 429/502/503 are
    retried (Retry-After, else 1 s) for up to limit_s: they mean nothing was done."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **dict(headers or {})},
        method="POST",
    )
    deadline = time.monotonic() + limit_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as err:
            if err.code not in RETRY_CODES or time.monotonic() > deadline:
                return err.code
            retry_after = err.headers.get("Retry-After", "")
            time.sleep(float(retry_after) if retry_after.isdigit() else 1.0)


def post_ok(url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> Any:
    """POST JSON and return the decoded answer; fail the test on an HTTP error."""
    answer = post(url, body, headers)
    assert not isinstance(answer, int), f"POST {url} failed: HTTP {answer}"
    return answer


def run_deployment(api: str, name: str, parameters: dict[str, Any], limit_s: float = 90) -> str:
    """Start a run of deployment `name` ("flow/deployment") through the Prefect API, as the
    UI's Run button does, once the deployment exists (a served one registers a moment after
    its process starts); the flow run's id. One HTTP poll, not a CLI process per try."""
    deployment = wait_for(
        lambda: get_json(f"{api}/deployments/name/{name}"), limit_s, f"deployment {name}"
    )
    run = post(f"{api}/deployments/{deployment['id']}/create_flow_run", {"parameters": parameters})
    assert isinstance(run, dict), f"creating a run of {name} failed: HTTP {run}"
    return str(run["id"])


def cancel_flow_run(api: str, flow_run: str) -> None:
    """Ask Prefect to cancel a flow run, as the UI's Cancel button does (state Cancelling;
    whatever runs the flow then stops it)."""
    state = {"type": "CANCELLING", "name": "Cancelling"}
    done = post(f"{api}/flow_runs/{flow_run}/set_state", {"state": state})
    assert isinstance(done, dict) and done.get("status") == "ACCEPT", f"cancel refused: {done}"


def service_env(**extra: str) -> dict[str, str]:
    """This process's environment plus unbuffered output, no telemetry and `extra`."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        **extra,
    }


@contextmanager
def background(
    argv: list[str], log: Path, env: Mapping[str, str], cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run argv in its own session with output in `log`; SIGINT (then SIGKILL) on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGINT to the process group, SIGKILL if it is still there after grace_s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def _wait_healthy(
    proc: subprocess.Popen[bytes], log: Path, health_url: str, what: str, limit_s: float
) -> None:
    """Wait until `health_url` answers; fail at once with the log's tail if `proc` exits."""

    def healthy() -> bool:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:]
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{tail}")
        return http_status(health_url) is not None

    wait_for(healthy, limit_s, what)


@contextmanager
def prefect_server(
    folder: Path, env: Mapping[str, str] | None = None, limit_s: float = 120, wait: bool = True
) -> Iterator[str]:
    """A real `prefect server start` (SQLite under `folder` unless env names a database);
    yields its API URL, once it answers (wait=False: at once; its log is
    `folder`/prefect-server.log)."""
    port = free_port()
    defaults = {
        "PREFECT_HOME": str(folder / "prefect-home"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{folder}/prefect.db",
        # The UI it serves asks this address (by default 4200's, whatever --port says).
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
    }
    server_env = service_env(**{**defaults, **dict(env or {})})
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
    log = folder / "prefect-server.log"
    with background([*argv, "--port", str(port)], log, server_env) as proc:
        api = f"http://127.0.0.1:{port}/api"
        if wait:
            _wait_healthy(proc, log, f"{api}/health", "the Prefect server", limit_s)
        yield api


@contextmanager
def mlflow_server(
    folder: Path,
    extra_args: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    limit_s: float = 120,
    port: int | None = None,
) -> Iterator[str]:
    """A real `mlflow server` (as the product starts one: tasks.tracking.mlflow_server) on a
    SQLite store under `folder` (on `port`, else a free one: give the same folder and port to
    start a stopped server again); yields its URL."""
    from trainflow.tasks.tracking.mlflow_server import JOB_EXECUTION
    from trainflow.tasks.tracking.mlflow_server import command as mlflow_command

    port = port or free_port()
    env = {JOB_EXECUTION: "false", **dict(env or {})}
    argv = [
        *mlflow_command("server", "--host", "127.0.0.1", "--port", str(port)),
        *("--backend-store-uri", f"sqlite:///{folder}/mlflow.db"),
        *("--artifacts-destination", str(folder / "mlartifacts"), "--workers", "1"),
        *(extra_args or []),
    ]
    log = folder / "mlflow-server.log"
    if log.exists():  # a restart: keep the earlier log
        log = folder / f"mlflow-server-{time.time_ns()}.log"
    with background(argv, log, service_env(**dict(env or {}))) as proc:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, log, f"{url}/health", "the MLflow server", limit_s)
        yield url


def apt_install(package: str, installed: Callable[[], bool]) -> str | None:
    """Install a Debian package unless `installed()` already holds; None on success, else why.

    Needs root and apt-get. A fresh machine may have no package lists yet, so `apt-get update`
    runs only when a first install fails.
    """
    if installed():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"needs `apt-get install {package}` as root (Debian)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends"]
    install += ["-o", "DPkg::Lock::Timeout=300", package]
    out = ""
    for argv in (install, ["apt-get", "update", "-q"], install):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        out += proc.stdout + proc.stderr
        if argv[1] == "install" and proc.returncode == 0 and installed():
            return None
    return f"`apt-get install {package}` failed:\n{out[-3000:]}"
