"""A warm `trainflow` command: a standing process with the command's libraries imported that
runs each `trainflow run` / `trainflow sweep` as a fork of itself.

A cold `trainflow run` spends its first ~3.5 s of an idle 2-core machine importing torch,
Prefect, MLflow and the pipeline before it checks anything, every time. `trainflow warm`
(started by `deploy/stack.sh up` beside the Prefect and MLflow servers, or by hand) imports them
once and listens on a private socket; a command that finds the socket in TRAINFLOW_WARM_SOCKET
hands it its arguments, folder, umask, environment and stdin/stdout/stderr, and the service
forks a child that runs the command's `main` exactly as the command would have, on the same
terminal, then hands back its exit status. The command process stays as the user's handle:
Ctrl-C, SIGTERM and SIGHUP are passed on to the child (which cancels its jobs as a cold command
does), and if the command dies the child gets SIGTERM.

The service runs a command only where the fork would behave as a fresh process: the same
Python, the same trainflow code and installed packages (a stamp of file times taken when it
started), and the same import-time environment (OMP_*, DASK_*, PYTHON* ...: read when the
libraries were imported). Otherwise the command says why in one line and runs itself, cold.
The user's own code is never imported by the service: the child imports it, as a cold command
does.
"""

import contextlib
import gc
import hashlib
import importlib
import io
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import sysconfig
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SOCKET_ENV = "TRAINFLOW_WARM_SOCKET"
"""The service's socket; a `trainflow run` or `sweep` that finds it set hands itself over."""

COMMANDS = ("run", "sweep")
"""The subcommands worth a fork: the others import little."""

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "prefect.flow_engine",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "distributed",
    "trainflow.flows.pipeline",
    "trainflow.flows.sweep",
    "trainflow.flows.early_server",
    "trainflow.tasks.train.job",
    "trainflow.tasks.train.model_plugins",
    "submitit.core.submission",
)
"""What a `trainflow run` imports before its first result, imported once by the service."""

IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NCCL",
                   "DASK_", "PYTHON", "LD_", "MALLOC", "NUMEXPR")  # fmt: skip
"""Environment variables read when libraries are imported: a command whose values differ from
the service's runs cold (its libraries would behave otherwise in a fresh process)."""

MAX_MESSAGE = 1 << 20

_added: dict[str, str] = {}
"""Environment variables the service's imports set (a fresh command's imports set them too)."""


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
    """The part of `env` that libraries read when they are imported (PYTHONUNBUFFERED is
    not: the served command's stdout is buffered as its own environment says)."""
    return {k: v for k, v in env.items()
            if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONUNBUFFERED"}  # fmt: skip


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
               "stamp": code_stamp()}  # fmt: skip
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
        print("trainflow: error: the warm command service ended during the run", file=sys.stderr)
        return 1
    code = int(json.loads(data)["returncode"])
    return code if code >= 0 else 128 - code


def _say(why: str) -> None:
    print(f"trainflow: {why}: running without the warm command service", file=sys.stderr)


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


# --- the service ---------------------------------------------------------------------------


def serve(path: Path) -> int:
    """Import the command's libraries, then serve commands on a socket at `path` until SIGTERM
    or SIGINT (running commands get SIGTERM then: they cancel their jobs)."""
    launched = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            traceback.print_exc()
    # What the imports put in the environment (torch: TORCHINDUCTOR_CACHE_DIR) a fresh
    # command has too: each child's environment is the command's plus these.
    _added.update({k: v for k, v in os.environ.items() if k not in launched})
    if threading.active_count() > 1:  # a fork copies only the calling thread
        print("trainflow warm: a library started a thread while imported: cannot fork safely")
        return 1
    stamp, env = code_stamp(), import_time_env(launched)
    gc.freeze()  # what is loaded now stays shared with every fork
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = path.parent.stat()
    if folder.st_uid != os.getuid() or folder.st_mode & 0o077:
        print(f"trainflow warm: {path.parent} must be a folder of yours that only you can open")
        return 2
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    stop = _stop_pipe()
    print(f"trainflow warm: serving on {path} (export {SOCKET_ENV}={path})", flush=True)
    children: dict[int, socket.socket] = {}
    stopped: set[int] = set()  # children whose command died: sent SIGTERM, not watched
    while True:
        watched: list[Any] = [listener, stop]
        watched += [c for pid, c in children.items() if pid not in stopped]
        ready, _, _ = select.select(watched, [], [], 0.5)
        if stop in ready:
            break
        for item in ready:
            if item is listener:
                _accept(listener, children, stamp, env)
            elif isinstance(item, socket.socket):
                stopped |= _client_gone(item, children)
        _reap(children)
        stopped &= set(children)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    path.unlink(missing_ok=True)
    return 0


def _stop_pipe() -> int:
    """A pipe whose read end turns readable at SIGTERM or SIGINT."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    return read


def _refusal(request: dict[str, Any], stamp: str, env: dict[str, str]) -> str | None:
    """Why this service cannot run the request as a fresh command would, or None."""
    if os.path.realpath(request["executable"]) != os.path.realpath(sys.executable):
        return f"the warm command service runs another Python ({sys.executable})"
    if request["stamp"] != stamp:
        return "trainflow's code or packages changed since the warm command service started"
    theirs = import_time_env(request["env"])
    differ = sorted(k for k in set(theirs) | set(env) if theirs.get(k) != env.get(k))
    if differ:
        return f"the warm command service was started with other {', '.join(differ[:3])}"
    return None


def _accept(
    listener: socket.socket, children: dict[int, socket.socket], stamp: str, env: dict[str, str]
) -> None:
    conn, _ = listener.accept()
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():
            raise PermissionError("a command of another user")
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(data)
    except (OSError, ValueError) as err:
        print(f"trainflow warm: refused a request: {err}", file=sys.stderr, flush=True)
        conn.close()
        return
    why = _refusal(request, stamp, env)
    if why is not None:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"cold": why}).encode())
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        _become_command(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode())
    print(f"trainflow warm: pid {pid} runs {' '.join(request['argv'])}", flush=True)


def _client_gone(conn: socket.socket, children: dict[int, socket.socket]) -> set[int]:
    """The command process closed its end (it died): its run is stopped as a SIGTERM would
    stop it; the pids signalled."""
    with contextlib.suppress(OSError):
        if conn.recv(16):
            return set()  # nothing is expected from a command: ignore
    pid = next((p for p, c in children.items() if c is conn), None)
    if pid is None:
        return set()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    return {pid}


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each ended child's exit status to its command."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"returncode": code}).encode())
        conn.close()
        print(f"trainflow warm: pid {pid} ended with {code}", flush=True)


def _become_command(request: dict[str, Any], fds: list[int]) -> None:
    """In the fork: take the command's stdio, folder, umask, environment, path and arguments,
    then run its `main` and end as the command would."""
    from trainflow.flows.cli import exit_fast, main

    code = 1
    try:
        os.setsid()  # the command passes its terminal's signals on; the service's are not ours
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update({**_added, **request["env"]})
        sys.path[:] = request["path"]
        _stdio(request["env"])
        _settings_from_environment()
        sys.argv = [sys.argv[0], *request["argv"]]
        code = main(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    exit_fast(code)


def _stdio(env: dict[str, str]) -> None:
    """sys.stdout and sys.stderr (on fds 1 and 2, now the command's) buffered as a fresh Python
    buffers them; the objects stay (log handlers made at import hold them)."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for stream, line in ((sys.stdout, os.isatty(1)), (sys.stderr, True)):
        if isinstance(stream, io.TextIOWrapper):
            stream.flush()
            stream.reconfigure(line_buffering=line, write_through=unbuffered)


def _settings_from_environment() -> None:
    """What Prefect read from the environment when the service imported it, read again from
    the command's: its settings (PREFECT_API_URL ...) and its logging (PREFECT_LOGGING_*).
    Forks of the command (the warm-rank server, its ranks) lose Prefect's log handlers: a cold
    command makes them before it imports Prefect."""
    import prefect.context
    from prefect.logging.configuration import setup_logging

    prefect.context.refresh_global_settings_context()
    setup_logging(incremental=False)
    os.register_at_fork(after_in_child=_without_prefect_handlers)


def _without_prefect_handlers() -> None:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        if isinstance(logger, logging.Logger):
            for handler in list(logger.handlers):
                if type(handler).__module__.startswith("prefect."):
                    logger.removeHandler(handler)
