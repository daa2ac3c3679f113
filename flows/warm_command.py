"""A warm `trainflow` command: a standing process with the command's libraries imported that
runs each `trainflow run` / `trainflow sweep` as a fork of itself.

A cold `trainflow run` spends its first ~3.5 s of an idle 2-core machine importing torch,
Prefect, MLflow and the pipeline before it checks anything, every time. `trainflow warm`
(started by `deploy/stack.sh up` beside the Prefect and MLflow servers, or by hand) imports them
once and listens on a private socket; a command that finds the socket in TRAINFLOW_WARM_SOCKET
hands it its arguments, folder, umask, resource limits (`ulimit`), environment and
stdin/stdout/stderr, and the service forks a child that runs the command's `main` exactly as the
command would have, on the same terminal, then hands back its exit status. The command process
stays as the user's handle: Ctrl-C, SIGTERM and SIGHUP are passed on to the child (which cancels
its jobs as a cold command does), and if the command dies the child gets SIGTERM.

The service runs a command only where the fork would behave as a fresh process: the same
Python, the same trainflow code and installed packages (a stamp of file times taken when it
started), and the same import-time environment (OMP_*, DASK_*, PYTHON* ...: read when the
libraries were imported). Otherwise the command says why in one line and runs itself, cold.
The user's own code is never imported by the service: the child imports it, as a cold command
does.
"""

import contextlib
import hashlib
import json
import os
import resource
import signal
import socket
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

SOCKET_ENV = "TRAINFLOW_WARM_SOCKET"
"""The service's socket; a `trainflow run` or `sweep` that finds it set hands itself over."""

COMMANDS = ("run", "sweep")
"""The subcommands worth a fork: the others import little."""


IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NCCL",
                   "DASK_", "PYTHON", "LD_", "MALLOC", "NUMEXPR")  # fmt: skip
"""Environment variables read when libraries are imported: a command whose values differ from
the service's runs cold (its libraries would behave otherwise in a fresh process)."""

SERVED_AS_THEIRS = ("PYTHONUNBUFFERED", "PYTHONPATH")
"""Import-time variables the fork follows the command in (stdout buffering, sys.path)."""


def code_stamp() -> str:
    """sha256 of this Python, trainflow's source files (names, sizes, mtimes) and the
    installed packages' folder time: changes when the code a fresh command imports changes."""
    root = Path(__file__).resolve().parents[1]  # flows/ -> the repo (or the installed tree)
    digest = hashlib.sha256(os.path.realpath(sys.executable).encode())
    for folder in ("flows", "tasks", "cluster"):
        for dirpath, _dirs, files in os.walk(root / folder):
            for name in sorted(f for f in files if f.endswith(".py")):
                info = os.stat(os.path.join(dirpath, name))
                digest.update(f"{dirpath}/{name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    site = Path(sysconfig.get_paths()["purelib"])
    digest.update(str(site.stat().st_mtime_ns if site.exists() else 0).encode())
    return digest.hexdigest()


def default_socket() -> Path:
    """$XDG_RUNTIME_DIR/trainflow/warm.sock, else /tmp/trainflow-<uid>/warm.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "trainflow" / "warm.sock"
    return Path(f"/tmp/trainflow-{os.getuid()}") / "warm.sock"


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` that libraries read when they are imported. Not PYTHONUNBUFFERED (the
    served command's stdout is buffered as its own environment says) nor PYTHONPATH (the fork
    takes the command's sys.path; the service checks it holds no other copy of a library)."""
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_ENV) and k not in SERVED_AS_THEIRS}  # fmt: skip


# --- the command's side --------------------------------------------------------------------


def run_served(argv: Sequence[str]) -> int | None:
    """Run this command in the warm service named by TRAINFLOW_WARM_SOCKET: its exit code, or
    None (said in one line) where the service cannot run it and the caller runs it itself."""
    path = os.environ.get(SOCKET_ENV)
    command = next((a for a in argv if not a.startswith("-")), None)
    if not path or command not in COMMANDS:
        return None
    request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ),
               "umask": _umask(), "path": sys.path, "executable": sys.executable,
               "stamp": code_stamp(), "limits": resource_limits()}  # fmt: skip
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(4096) or b"{}")
    except (OSError, ValueError) as err:
        conn.close()
        _say(f"the warm command service at {path} did not answer ({err})")
        return None
    if "pid" not in reply:
        conn.close()
        _say(str(reply.get("cold", "it refused the command")))
        return None
    return _wait_served(conn, int(reply["pid"]))


def _wait_served(conn: socket.socket, pid: int) -> int:
    """Pass our signals on to the served child until the service sends its exit status."""

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            data = conn.recv(4096)
            break
        except InterruptedError:  # a signal arrived and was passed on: keep waiting
            continue
    if not data:
        print(
            "trainflow: error: the warm command service ended during the run (the run got "
            "SIGTERM: it cancelled its jobs)",
            file=sys.stderr,
        )
        return 1
    code = int(json.loads(data)["returncode"])
    return code if code >= 0 else 128 - code


def resource_limits() -> dict[str, list[int]]:
    """This process's resource limits (`ulimit -a`: open files, address space ...), name ->
    [soft, hard]: the served child sets them, as a fresh command would start with them."""
    return {
        name: list(resource.getrlimit(getattr(resource, name)))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }


def _say(why: str) -> None:
    print(f"trainflow: {why}: running without the warm command service", file=sys.stderr)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
