"""Drives flows.held_server's fork as `trainflow run` does, in a process of its own, and prints
what tests/unit/test_prewarm.py checks as one JSON line (a test payload)."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import prefect  # noqa: F401 -- as the command has, before it holds the server
import psutil

from tests.services import http_status
from trainflow.cluster.warm_pool import ForkedServer
from trainflow.flows.early_server import _let_go, hold_temporary_server, start_temporary_server

SEED_ENV = "TRAINFLOW_TEST_PREFECT_DB"
"""A Prefect database to copy in before the released server starts (tests/conftest.py)."""


def _holds_pipe(pid: int, inode: int) -> bool:
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    return f"pipe:[{inode}]" in links


def orphaned() -> None:
    """Release a forked server, say its pid, then wait to be killed (SIGKILL: no atexit)."""
    held = hold_temporary_server()
    server = start_temporary_server(held)
    assert server is not None and held is not None
    server.wait()
    print(json.dumps({"server": held.pid}), flush=True)
    time.sleep(600)


def main() -> None:
    db = Path(os.environ["PREFECT_API_DATABASE_CONNECTION_URL"].split("///", 1)[1])
    report: dict[str, object] = {"pid_of_command": os.getpid()}
    _pipe_r, pipe_w = os.pipe()  # stands for the warm-rank server's stdin pipe
    refused = hold_temporary_server()
    assert refused is not None
    report["forked"] = isinstance(refused, ForkedServer)
    report["parent"] = psutil.Process(refused.pid).ppid()
    time.sleep(1)
    report["pipe_held_by_fork"] = _holds_pipe(refused.pid, os.fstat(pipe_w).st_ino)
    report["held_listens"] = psutil.Process(refused.pid).net_connections(kind="inet")
    _let_go(refused)  # what the command's exit does when the model was refused
    report["refused_ended"] = refused.returncode is not None
    report["db_after_refusal"] = db.exists()
    if SEED_ENV in os.environ:  # a database at Prefect's head: no migration to wait for
        shutil.copyfile(os.environ[SEED_ENV], db)

    held = hold_temporary_server()
    server = start_temporary_server(held)
    assert server is not None and held is not None
    try:
        url = server.wait()
        report["health"] = http_status(f"{url}/health")
        report["released_listens"] = bool(psutil.Process(held.pid).net_connections(kind="inet"))
    finally:
        server.stop(quiet=True)
    report["health_after_stop"] = http_status(f"{url}/health")
    print(json.dumps(report))


if __name__ == "__main__":
    orphaned() if sys.argv[1:] == ["--orphaned"] else main()
