"""MLflow's own server command in one process:
`python -m trainflow.tasks.tracking.mlflow_server server|ui <mlflow's options>`.

`mlflow server` validates its options, initialises the stores, sets the server's environment and
then starts uvicorn as a child process (`python -m uvicorn ... mlflow.server.fastapi_app:app`),
which imports MLflow a second time while the parent only waits for it. Measured here (AMD EPYC,
2 cores, a seeded SQLite store, `--workers 1`): the parent 3.2 CPU s, the child 2.5, healthy
after 6.5 s. This runs the same CLI (every option, check and environment variable is MLflow's)
and hands its uvicorn command to uvicorn in this process instead: one import of MLflow, one
process to signal (SIGINT and SIGTERM stop uvicorn gracefully, as they stopped the child).

Anything else MLflow would start (gunicorn, waitress, or its job runner, which it launches
beside the server once the child is running: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true) keeps
MLflow's own two-process path. trainflow's servers (`trainflow ui`, deploy/stack.sh, the tests)
turn job execution off: they run no MLflow GenAI jobs, and it costs a runner and ~1.5 GB.
"""

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_UVICORN = [sys.executable, "-m", "uvicorn"]


def serve(args: Sequence[str]) -> NoReturn:
    """Run `mlflow <args>` (`server ...` or `ui ...`) with its uvicorn in this process; exits
    with the server's exit code (MLflow's usage errors: 2, as its own command)."""
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    import mlflow.server
    from mlflow.cli import cli

    spawn = mlflow.server._exec_cmd

    def in_process(cmd: list[str], *, extra_env: dict[str, str] | None = None, **kw: Any) -> Any:
        if cmd[: len(_UVICORN)] != _UVICORN or _job_execution():
            return spawn(cmd, extra_env=extra_env, **kw)
        os.environ.update(extra_env or {})
        from uvicorn.main import main as uvicorn_main

        uvicorn_main.main(args=cmd[len(_UVICORN) :], prog_name="uvicorn")  # exits
        raise SystemExit(0)  # pragma: no cover - click's standalone mode always exits

    mlflow.server._exec_cmd = in_process
    cli.main(args=list(args), prog_name="mlflow")  # exits (standalone mode)
    raise SystemExit(0)  # pragma: no cover


def _job_execution() -> bool:
    """Whether MLflow will start its job runner beside the server (then: its own path)."""
    from mlflow.environment_variables import MLFLOW_SERVER_ENABLE_JOB_EXECUTION

    return bool(MLFLOW_SERVER_ENABLE_JOB_EXECUTION.get())


def command(*args: str) -> list[str]:
    """The command line that runs `mlflow <args>` through this module."""
    return [sys.executable, "-m", "trainflow.tasks.tracking.mlflow_server", *args]


if __name__ == "__main__":
    serve(sys.argv[1:])
