"""Both ends of cluster.warm_ranks outside the server: starting it in the flow process (once,
reused by every local job of that process), and a guard's forked rank seen as a child process.

Importing this module is cheap (no torch, no submitit): the `trainflow` command starts the
server before it imports Prefect, so the ranks' imports run beside the flow's own.
"""

import atexit
import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NoReturn, TypeVar

from trainflow.cluster.prctl import name_process

T = TypeVar("T")

_pool: "tuple[subprocess.Popen[bytes] | ForkedServer, Path] | None" = None
_used = False  # whether a job was handed this pool's socket (else at exit it is killed)

DISABLE_ENV = "TRAINFLOW_COLD_RANKS"
"""Set to 1 to start every local rank as a fresh process (as before the warm ranks)."""


def warm_pool(for_job: bool = True) -> Path | None:
    """The socket of this process's warm-rank server, started on first call; None when
    disabled (TRAINFLOW_COLD_RANKS=1) or when it has exited. `for_job=False` only starts it
    (the `trainflow` command, at its start): if no job uses it, it is killed at exit."""
    global _pool, _used
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    _used = _used or for_job
    if _pool is not None:
        proc, path = _pool
        return path if proc.poll() is None else None
    folder, path, listener = _listening_socket()
    with listener:
        fd = listener.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainflow.cluster.warm_ranks", str(fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=(folder / "server.log").open("wb"),
            pass_fds=(fd,),
            start_new_session=True,  # a terminal's Ctrl-C is the flow's to handle, not its
        )
    _pool = (proc, path)
    atexit.register(_stop, proc, folder)
    return path


def _listening_socket() -> tuple[Path, Path, socket.socket]:
    """A private folder, the server's socket path in it and the socket, bound and listening
    before the server starts: a guard may connect at once (it waits in the backlog until the
    server's imports are done)."""
    folder = Path(tempfile.mkdtemp(prefix="trainflow-warm-"))  # 0700: the socket is private
    path = folder / "ranks.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(64)
    return folder, path, listener


class ForkedServer:
    """The server when fork_pool forked it from this process: as much of a Popen as this
    module uses (pid, poll, kill, wait, stdin)."""

    def __init__(self, pid: int, stdin: int) -> None:
        self.pid = pid
        self.stdin: BinaryIO | None = os.fdopen(stdin, "wb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once it has ended (reaped here), else None."""
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for its end; the exit code (negative: its signal); TimeoutExpired as Popen
        raises it when `timeout` seconds pass first."""
        if timeout is not None:
            deadline = time.monotonic() + timeout
            while (code := self.poll()) is None:
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(["forked", str(self.pid)], timeout)
                time.sleep(0.02)
            return code
        while (code := self.poll()) is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped by somebody else
        return code

    def send_signal(self, sig: int) -> None:
        """Signal it while it runs."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM it."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL it."""
        self.send_signal(signal.SIGKILL)


def fork_pool(first: Callable[[], T]) -> Callable[[], T] | None:
    """Start this process's warm-rank server as a fork of it, which runs `first()` before it
    serves: the `trainflow` command forks once torch is imported and has the fork check the
    user's model (torch, dynamo and the model's own imports: what the ranks need anyway),
    while it imports Prefect and MLflow itself; one process imports torch instead of two.

    Returns a callable that waits for `first`'s outcome and returns its value or raises its
    exception (the fork then exits: no server is left). None where no fork is possible
    (TRAINFLOW_COLD_RANKS=1, a server already runs, or this process runs other threads: a
    fork copies only the calling thread): the caller runs `first` itself."""
    global _pool
    if os.environ.get(DISABLE_ENV) == "1" or _pool is not None or threading.active_count() > 1:
        return None
    folder, path, listener = _listening_socket()
    stdin_r, stdin_w = os.pipe()
    result_r, result_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd in (stdin_w, result_r):
            os.close(fd)
        _forked_server(first, listener, stdin_r, result_w, folder / "server.log")
    os.close(stdin_r)
    os.close(result_w)
    listener.close()
    server = ForkedServer(pid, stdin_w)
    _pool = (server, path)
    atexit.register(_stop, server, folder)

    def outcome() -> T:
        with os.fdopen(result_r, "rb") as pipe:
            data = pipe.read()
        if data:
            ok, value = pickle.loads(data)
            if ok:
                return value
        stop_pool()  # it refused, or died: no server is left behind
        if not data:
            raise RuntimeError(
                f"the warm-rank server died while it ran {first!r} (exit code {server.wait()}): "
                f"rerun with {DISABLE_ENV}=1 and report it, with {folder / 'server.log'}"
            )
        assert isinstance(value, BaseException)
        raise value

    return outcome


def _forked_server(
    first: Callable[[], T], listener: socket.socket, stdin: int, result: int, log: Path
) -> NoReturn:
    """In the fork: its own session (the terminal's Ctrl-C is the flow's to handle), run
    `first` with the command's stdio, hand back its outcome, then serve with stdin a pipe from
    the flow and stderr in `log`, as a server started by warm_pool is."""
    code = 0
    try:
        os.setsid()
        name_process(b"trainflow-warm")  # `ps` tells it from the command it is a copy of
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the flow stops it by closing its stdin
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        modules, path = set(sys.modules), list(sys.path)
        try:
            outcome: tuple[bool, object] = (True, first())
        except BaseException as err:
            outcome = (False, _picklable(err))
        _forget_user_code(modules, path)
        sys.stdout.flush()
        sys.stderr.flush()
        with os.fdopen(result, "wb") as pipe:
            pipe.write(pickle.dumps(outcome))
        if outcome[0]:
            _serve_forked(listener, stdin, log)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _forget_user_code(modules: set[str], path: list[str]) -> None:
    """Drop what `first` imported from outside the environment (the user's model and the
    modules it imports) and the folders it added to sys.path: a rank must import the user's
    code from the run's snapshot (cluster.snapshot), as a fresh rank does, never a copy that
    the server imported from the project."""
    from trainflow.cluster.snapshot import user_module

    for name in set(sys.modules) - modules:
        if user_module(name):
            del sys.modules[name]
    sys.path[:] = path


def _picklable(err: BaseException) -> BaseException:
    """`err` with its traceback as a note (shown by --debug), or a RuntimeError saying what it
    was where it does not pickle."""
    err.add_note("".join(traceback.format_exception(err)).rstrip())
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def _serve_forked(listener: socket.socket, stdin: int, log: Path) -> None:
    from trainflow.cluster.warm_ranks import serve

    os.dup2(stdin, 0)
    os.close(stdin)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 1)
    with log.open("ab") as out:
        os.dup2(out.fileno(), 2)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (serve selects on it; fd 0 stays)
    serve(listener)  # imports what `first` did not (dynamo, MLflow, the job), then forks ranks


def _stop(proc: "subprocess.Popen[bytes] | ForkedServer", folder: Path) -> None:
    """Close the server's stdin: it exits once its last rank has ended (at once when no job
    ever used it: it may still be importing then)."""
    global _pool, _used
    _pool = None
    if not _used:
        proc.kill()
        proc.wait()
    _used = False
    if proc.stdin is not None:
        proc.stdin.close()
    shutil.rmtree(folder, ignore_errors=True)


def stop_pool() -> None:
    """Stop this process's server now (the next local job starts a new one)."""
    if _pool is not None:
        proc, path = _pool
        _stop(proc, path.parent)
        proc.wait()


def running_pool() -> Path | None:
    """The socket of this process's warm-rank server if one runs (never starts one)."""
    if _pool is None or _pool[0].poll() is not None:
        return None
    return _pool[1]


def pool_pid() -> int | None:
    """The server's pid while it runs (tests)."""
    return _pool[0].pid if _pool is not None and _pool[0].poll() is None else None


class WarmChild:
    """A rank forked by the warm-rank server, handled as the guard handles a Popen child."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        """Signal the rank (it is this guard's child in all but name)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the rank."""
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """The rank's returncode (negative: its signal); TimeoutExpired as Popen raises it."""
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(4096)
        except TimeoutError:
            raise subprocess.TimeoutExpired(["warm rank", str(self.pid)], timeout or 0) from None
        # The server died (its children die with it, PDEATHSIG): the rank was killed.
        self.returncode = int(json.loads(data)["returncode"]) if data else -signal.SIGKILL
        self._conn.close()
        return self.returncode


def _current_umask() -> int:
    """This process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def spawn_warm(socket_path: str, command: list[str], env: dict[str, str]) -> WarmChild | None:
    """Have the server fork `command` (`<python> -u -m <module> args...`, this interpreter)
    with this process's stdio, folder and `env`; None where it cannot, and the guard then
    starts the command itself."""
    if len(command) < 4 or command[1:3] != ["-u", "-m"]:
        return None
    if os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return None
    request = {
        **{"module": command[3], "args": command[4:], "cwd": os.getcwd(), "env": env},
        "umask": _current_umask(),  # 077 for a private job folder (cluster.job_folder)
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(socket_path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        # Waits while the server still imports (it accepts once its imports are done).
        reply = conn.recv(4096)
        pid = int(json.loads(reply)["pid"])
    except (OSError, ValueError, KeyError) as err:
        conn.close()
        print(f"rank_guard: no warm rank ({err}): starting a fresh process", file=sys.stderr)
        return None
    return WarmChild(conn, pid)
