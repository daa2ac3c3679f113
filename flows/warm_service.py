"""The warm command service (`trainflow warm`, flows.warm_command for what it is): imports the
command's libraries once, then runs each command it is handed as a fork of itself, in the
command's cgroups and resource limits, and hands back its exit status."""

import contextlib
import gc
import importlib
import io
import json
import logging
import os
import resource
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from trainflow.cluster.prctl import die_with_parent
from trainflow.flows.warm_command import SOCKET_ENV, code_stamp, import_time_env
from trainflow.flows.warm_refusals import refusal
from trainflow.tasks.import_gc import imports_without_gc

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

MAX_MESSAGE = 1 << 20

_added: dict[str, str] = {}
"""Environment variables the service's imports set (a fresh command's imports set them too)."""


def serve(path: Path) -> int:
    """Import the command's libraries, then serve commands on a socket at `path` until SIGTERM
    or SIGINT (running commands get SIGTERM then: they cancel their jobs)."""
    if _answers(path):
        print(f"trainflow warm: a service already serves on {path} (stop it first)")
        return 2
    launched = dict(os.environ)
    with imports_without_gc():  # 15-25% less CPU (tasks.import_gc)
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:
                traceback.print_exc()
        try:  # the stages' modules: the pipeline's module leaves them to a run
            from trainflow.flows.pipeline import import_stages

            import_stages()
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
    path.unlink(missing_ok=True)  # a dead service's socket
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


def _answers(path: Path) -> bool:
    """Whether a process listens on the socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _stop_pipe() -> int:
    """A pipe whose read end turns readable at SIGTERM or SIGINT."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    return read


def _take_limits(limits: dict[str, list[int]]) -> None:
    """Set the command's resource limits (`ulimit -n 256` ...) in this fork: it runs within
    what the command would have."""
    for name, (soft, hard) in limits.items():
        res = getattr(resource, name, None)
        if res is not None and resource.getrlimit(res) != (soft, hard):
            resource.setrlimit(res, (soft, hard))


def _accept(
    listener: socket.socket, children: dict[int, socket.socket], stamp: str, env: dict[str, str]
) -> None:
    conn, _ = listener.accept()
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        peer, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise PermissionError("a command of another user")
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(data)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} file descriptors, not stdin, stdout and stderr")
    except (OSError, ValueError) as err:
        print(f"trainflow warm: refused a request: {err}", file=sys.stderr, flush=True)
        conn.close()
        return
    why = refusal(request, stamp, env)
    if why is not None:
        print(f"trainflow warm: ran cold: {' '.join(request['argv'])}: {why}", flush=True)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"cold": why}).encode())
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        os.close(go_write)
        if not os.read(go_read, 1):  # the service could not place it: end unseen
            os._exit(0)
        os.close(go_read)
        _become_command(request, fds)  # never returns
    os.close(go_read)
    for fd in fds:
        os.close(fd)
    why = _join_cgroups(pid, peer)
    if why is not None:
        os.close(go_write)
        os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"cold": why}).encode())
        conn.close()
        return
    os.write(go_write, b"1")
    os.close(go_write)
    children[pid] = conn
    conn.sendall(json.dumps({"pid": pid}).encode())
    print(f"trainflow warm: pid {pid} runs {' '.join(request['argv'])}", flush=True)


def _cgroups(pid: int) -> dict[str, str]:
    """hierarchy (its controllers, or "" for cgroup v2) -> the cgroup `pid` is in."""
    found = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            found[controllers] = path
    return found


def _join_cgroups(child: int, command: int) -> str | None:
    """Move the forked child into the command's cgroups where they differ from the service's
    (a Slurm job's, a memory limit): it runs where and within what the command would have.
    None when done; else why it cannot (the command then runs itself)."""
    ours = _cgroups(os.getpid())
    for controllers, path in _cgroups(command).items():
        if ours.get(controllers) == path:
            continue
        name = controllers.removeprefix("name=")  # v1: its folder; v2: "" (unified)
        base = Path("/sys/fs/cgroup") / (name or "unified")
        if not name and not base.exists():
            base = Path("/sys/fs/cgroup")  # a v2-only machine
        try:
            (base / path.lstrip("/") / "cgroup.procs").write_text(str(child))
        except OSError as err:
            return (f"the command runs in the {name or 'v2'} cgroup {path}, which the warm "
                    f"command service cannot join ({err.strerror})")  # fmt: skip
    return None


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
    """Send each ended child's exit status to its command (cluster.warm_ranks.reap)."""
    from trainflow.cluster.warm_ranks import reap

    for pid, _conn, code in reap(children):
        print(f"trainflow warm: pid {pid} ended with {code}", flush=True)


def _become_command(request: dict[str, Any], fds: list[int]) -> None:
    """In the fork: take the command's stdio, folder, umask, resource limits, environment,
    path and arguments, then run its `main` and end as the command would."""
    from trainflow.flows.cli import exit_fast, main

    code = 1
    try:
        os.setsid()  # the command passes its terminal's signals on; the service's are not ours
        # SIGTERM when the service dies (killed outright): the run cancels its jobs and ends,
        # as its command, which lost the service, reports (never a run nobody waits for).
        die_with_parent(signal.SIGTERM)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        _take_limits(request.get("limits", {}))
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
