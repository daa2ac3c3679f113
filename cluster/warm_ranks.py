"""Warm ranks for the local executor: a process with torch, torch._dynamo and MLflow imported
that forks each rank, instead of each rank importing them afresh.

On 2 CPU cores every rank of a local job used to spend ~4-6 CPU seconds importing the same
libraries (torch ~2 s, dynamo ~1.6 s, MLflow ~1.5 s), one rank after the other, after the flow
had submitted the job. This server (the "zygote") is started with the `trainflow` command
(cluster.warm_pool), imports them once while the flow imports Prefect and preprocesses, and then
forks a child per rank that runs the rank's usual command (`python -u -m
submitit.core._submit <folder>`) in-process. The fork is a copy of a process that has run no
torch op (no thread pool, no CUDA, no process group yet), as PyTorch's own DataLoader workers are.

The rank guard (cluster.rank_guard) stays the rank's parent in every way that matters: it
connects here, hands over its command, environment, working folder and stdin/stdout/stderr,
learns the child's pid (it signals it directly and records it for lost-rank naming) and gets
the child's exit status back. When the guard dies (the local controller's SIGKILL after a
cancel), its connection closes and the child is killed at once; when this server dies, its
children die with it (PDEATHSIG). It serves forever, one fork per request, and exits once its
stdin (a pipe from the flow process) closes and none of its children is left: ranks of a job
whose flow was killed keep running, as they did before, for `trainflow cleanup`.

Only the user's own code is never preloaded: it is imported by the job from the run's code
snapshot in the child, exactly as in a cold rank.
"""

import atexit
import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Any

from trainflow.cluster.prctl import die_with_parent
from trainflow.tasks.import_gc import imports_without_gc

PRELOAD = (
    "torch",
    "torch._dynamo",  # DDP's constructor and every torch.optim optimizer import it
    "torch.distributed",
    "submitit.core.submission",  # what the rank's `-m trainflow.cluster.rank_main` runs
    "trainflow.tasks.train.job",
)
"""What every rank imports anyway, imported once here before the first fork. Not MLflow: ranks
journal what they log and the flow sends it (tasks.tracking.journal)."""

LATER = (
    "torch.export._trace",
    "trainflow.tasks.evaluate.model_logging",  # MLflow with it
    "mlflow.store.tracking.sqlalchemy_store",  # the export's model logged to a SQLite store
)
"""What the evaluate stage's model export (tasks.evaluate.warm_export) imports, imported once
the first job that trained has ended (its ranks all gone, one at least with exit code 0: the
ranks need none of it; imported while they train, it took CPU from them on 2 cores), while the
flow evaluates the test split. Not after a job whose ranks were killed or failed: no evaluate
stage follows, and the flow that cancelled it is closing this server's stdin (the imports took
2.6 CPU s on a Zen 3, over 10 s at load 7, and kept a cancelled run's server alive for them)."""

MAX_MESSAGE = 1 << 20
"""A request (command line and environment) must fit one SOCK_SEQPACKET message."""


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import `modules` (garbage collector paused: tasks.import_gc); one that fails is left for
    the rank to import (and report) itself."""
    with imports_without_gc():
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:
                traceback.print_exc()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def serve(listener: socket.socket) -> None:
    """Preload, then serve the guards connecting to `listener` (bound and listening already:
    guards that connect while the imports run wait in its backlog)."""
    preload()
    gc.freeze()  # what is loaded now stays shared with every fork (no copy-on-write by gc)
    children: dict[int, socket.socket] = {}  # pid -> the guard's connection
    owners: dict[socket.socket, int] = {}
    stdin_open = True
    later, trained = list(LATER), False
    while stdin_open or children:
        if later and trained and not children:  # the first job that trained has ended
            preload(tuple(later))
            later.clear()
            gc.freeze()
        watched = [listener, *owners] + ([sys.stdin] if stdin_open else [])
        ready, _, _ = select.select(watched, [], [], 0.2)
        for item in ready:
            if item is listener:
                _accept(listener, children, owners)
            elif isinstance(item, socket.socket):
                _guard_gone(item, children, owners)
            else:  # stdin: the flow closes it when it is done with this server
                stdin_open = bool(os.read(sys.stdin.fileno(), 4096))
        trained = _reap(children, owners) or trained


def _accept(
    listener: socket.socket, children: dict[int, socket.socket], owners: dict[socket.socket, int]
) -> None:
    """Fork a rank for one guard's request; the guard learns the child's pid."""
    conn, _ = listener.accept()
    try:
        if _peer_uid(conn) != os.getuid():
            raise PermissionError("a guard of another user")
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(data)
    except (OSError, ValueError) as err:
        print(f"warm_ranks: refused a request: {err}", file=sys.stderr, flush=True)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in owners:
            other.close()
        _become_rank(request, fds, conn)  # never returns
    for fd in fds:
        os.close(fd)
    children[pid] = conn
    owners[conn] = pid
    conn.sendall(json.dumps({"pid": pid}).encode())


def _guard_gone(
    conn: socket.socket, children: dict[int, socket.socket], owners: dict[socket.socket, int]
) -> None:
    """The guard's connection closed (or spoke out of turn): its rank must not outlive it."""
    try:
        if conn.recv(16):
            return  # nothing is expected from a guard after its request: ignore
    except OSError:
        pass
    pid = owners.pop(conn)
    children.pop(pid, None)
    conn.close()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def reap(children: dict[int, socket.socket]) -> list[tuple[int, socket.socket, int]]:
    """Send each ended child's exit status (Popen's returncode convention) on its connection
    and close it; (pid, connection, code) of each (the warm command service shares this)."""
    ended = []
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"returncode": code}).encode())
        conn.close()
        ended.append((pid, conn, code))
    return ended


def _reap(children: dict[int, socket.socket], owners: dict[socket.socket, int]) -> bool:
    """Send each ended rank's exit status to its guard; True when one of them succeeded."""
    succeeded = False
    for _pid, conn, code in reap(children):
        owners.pop(conn, None)
        succeeded = succeeded or code == 0
    return succeeded


def _become_rank(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked child: take the guard's stdio, folder, umask and environment, run the
    module."""
    code = 1
    try:
        die_with_parent(signal.SIGKILL)  # the server's death kills its ranks
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])  # the guard's (077 under a job): not the server's
        os.environ.clear()
        os.environ.update(request["env"])
        _unbuffered_stdio()
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _set_path(request["cwd"], request["env"].get("PYTHONPATH", ""))
        code = _run_module(request["module"], request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _unbuffered_stdio() -> None:
    """New stdout/stderr on fds 1 and 2, unbuffered as `python -u` makes them."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True, write_through=True)  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")


def _set_path(cwd: str, pythonpath: str) -> None:
    """sys.path as `python -m` in `cwd` with this PYTHONPATH starts it."""
    extra = [p for p in pythonpath.split(os.pathsep) if p and p not in sys.path]
    sys.path[0:1] = [cwd, *extra]


def _run_module(module: str, args: list[str]) -> int:
    """Run `module` as __main__, then end as the interpreter would (threads joined, atexit)."""
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the flow stops it by closing its stdin
    serve(socket.socket(fileno=int(sys.argv[1])))  # the listening socket cluster.warm_pool made
