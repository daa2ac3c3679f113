"""MLflow's own server command, as trainflow starts it (`trainflow ui`, deploy/stack.sh, tests).

MLflow's job runner (MLFLOW_SERVER_ENABLE_JOB_EXECUTION) is off unless the caller set it: it
serves MLflow's GenAI jobs, which trainflow does not use, and forks a runner and ~1.5 GB of
workers beside the server.
"""

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def command(*args: str) -> list[str]:
    """The command line that runs `mlflow <args>` with this interpreter's MLflow."""
    return [sys.executable, "-m", "mlflow", *args]


def serve(args: Sequence[str]) -> NoReturn:
    """Become `mlflow <args>` (`server ...` or `ui ...`): this process is replaced, so Ctrl-C
    and signals reach MLflow's server as if it had been started directly."""
    os.environ.setdefault(JOB_EXECUTION, "false")
    argv = command(*args)
    os.execv(argv[0], argv)
