"""Both ends of cluster.warm_ranks outside the server: starting it in the flow process (once,
reused by every local job of that process), and a guard's forked rank seen as a child process.

Importing this module is cheap (no torch, no submitit): the `trainflow` command starts the
server before it imports Prefect, so the ranks' imports run beside the flow's own.
"""

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

_pool: tuple[subprocess.Popen[bytes], Path] | None = None
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
    folder = Path(tempfile.mkdtemp(prefix="trainflow-warm-"))  # 0700: the socket is private
    path = folder / "ranks.sock"
    # Bound and listening before the server starts: a guard may connect at once (it waits in
    # the backlog until the server's imports are done).
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(64)
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


def _stop(proc: subprocess.Popen[bytes], folder: Path) -> None:
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
