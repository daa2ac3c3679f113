"""A small parent for each rank process, so that a rank's end is recorded however it came.

A rank killed by a signal (kill -9, the OOM killer) writes no result: only its parent learns
how it ended, and neither submitit's local controller nor Slurm's srun keeps that where the
flow can read it. The executors (cluster.executor) therefore start every rank as

    python -m trainflow.cluster.rank_guard --peer-timeout-s 60 <the rank's command ...>

which runs the command as its child and writes two small JSON files beside submitit's result
pickle: ``<job id>_<task>_rank.json`` when the rank starts (node, pid) and
``<job id>_<task>_exit.json`` when it has ended (exit code or signal, OOM kill when the kernel's
cgroup counter says so). Then it ends the same way its child did, so srun and the local
controller see what they saw before. cluster.lost_ranks turns these files into the message.
It also hands the rank its collective timeout (cluster.peer_timeout_s) in the environment.

A rank that stops making progress: the training job beats into ``<job id>_<task>_beat``
(cluster.heartbeat) and the guard reads it every second. Silent past its phase's allowance
(train.hang_timeout_s, hang_first_step_s), the rank is hung: the guard has it dump the stacks of
all its threads (SIGUSR1, faulthandler) into ``<job id>_<task>_stacks.txt``, copies them into
the rank's log, kills the rank and records `hung` (phase, step, seconds silent, the frame it is
stuck in) in its exit record; cluster.lost_ranks names it, and its peers end as after a loss.

A peer's end: while its rank runs, the guard reads the job's other exit records every second.
When a peer has ended without success (a signal, a non-zero code: lost, or it raised) and this
rank is still running PEER_GRACE_S later, the guard ends it (SIGKILL) and records
`ended_for_peer`: the survivors of a lost rank otherwise sit in a collective until the peer
timeout (seen: two FSDP ranks blocked on each other in an all-gather for gloo's 60 s after a
third was killed). cluster.lost_ranks names the peer, not these ranks.

Signals: under the local executor only this process is signalled (the controller signals the
task it started), so SIGINT, SIGTERM, SIGUSR1/2 and SIGCONT are passed on to the rank. Under
Slurm the step's signals reach every process of the task (proctrack), the rank included: this
process ignores them then and waits for the rank, instead of signalling it twice.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainflow.cluster.hang_watch import HangWatch
from trainflow.cluster.prctl import die_with_parent

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def identity() -> tuple[Path, str, int]:
    """(submitit folder, job id, task) of this rank, from the command line and environment."""
    from submitit import JobEnvironment

    env = JobEnvironment()
    folder = Path(sys.argv[-1])
    return folder, str(env.job_id), env.global_rank


def node_name() -> str:
    """The Slurm node this rank runs on (the dev cluster's nodes share one hostname)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def oom_kills() -> int | None:
    """The kernel's count of OOM kills in this process's cgroup (v2 memory.events), if readable."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[-1]
        events = Path("/sys/fs/cgroup") / line.split(":", 2)[2].lstrip("/") / "memory.events"
        for entry in events.read_text().splitlines():
            key, value = entry.split()
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` atomically, owner-only like submitit's own files."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _pass_on(child: "subprocess.Popen[bytes]") -> None:
    """Install handlers that forward (local) or ignore (Slurm) the step's signals."""
    under_slurm = "SLURM_STEP_ID" in os.environ or "SLURM_JOB_ID" in os.environ
    for sig in FORWARDED:
        if under_slurm:
            signal.signal(sig, signal.SIG_IGN if sig != signal.SIGCONT else signal.SIG_DFL)
        else:
            signal.signal(sig, lambda signum, _frame: child.send_signal(signum))


def end_like(returncode: int) -> None:
    """Leave with the child's exit code, or die of the child's signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if returncode >= 0:
        os._exit(returncode)
    sig = -returncode
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be set (always default)
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal this process may not die of (e.g. SIGSTOP)


HUNG_AFTER_RESULT_S = float(os.environ.get("TRAINFLOW_HUNG_AFTER_RESULT_S", "20"))
"""How long a rank may live on after its result is written before the guard ends it."""
PEER_GRACE_S = float(os.environ.get("TRAINFLOW_PEER_GRACE_S", "5"))
"""How long a rank may run on after a peer ended without success before the guard ends it: a
collective that lost its peer usually fails by itself within this (and then the rank's own
error is recorded, which says more)."""


def ended_peer(folder: Path, job_id: str, task: int, since: float) -> dict[str, Any] | None:
    """The exit record of a peer of this rank (same job, this attempt: ended at or after
    `since`) that ended without success and was not itself ended for a peer; else None."""
    pattern = re.compile(rf"{re.escape(job_id)}_(\d+)_exit\.json")
    for path in folder.glob(f"{job_id}_*_exit.json"):
        match = pattern.fullmatch(path.name)
        if not match or int(match[1]) == task:
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        code = record.get("returncode")
        if (
            isinstance(code, int)
            and code != 0
            and float(record.get("ended", 0)) >= since
            and not record.get("hung_after_result")
            and record.get("ended_for_peer") is None
        ):
            return dict(record)
    return None


def _outcome(result: Path) -> str | None:
    """'success' or 'error' once submitit has written the rank's result, else None."""
    try:
        from submitit.core.utils import pickle_load

        outcome, _ = pickle_load(result)
    except Exception:  # not there yet, or being written
        return None
    return str(outcome)


def _written_since(result: Path, since: float) -> bool:
    """Whether `result` was written at or after `since` (a requeued attempt finds the result
    file of the attempt before it, e.g. a non-zero rank's error when Slurm stopped it)."""
    try:
        return result.stat().st_mtime >= since
    except OSError:
        return False


def _wait(
    child: "subprocess.Popen[bytes]",
    result: Path,
    since: float,
    peer: "Callable[[], dict[str, Any] | None]" = lambda: None,
    watch: HangWatch | None = None,
) -> tuple[int, bool, int | None]:
    """The child's exit code, whether it had to be killed after delivering its result (a
    result file older than `since`, the rank's start, is an earlier attempt's), and the task
    of the peer whose end made the guard end it (`peer()`: ended_peer for this rank), if so.

    A rank whose result is written but which does not exit within HUNG_AFTER_RESULT_S is stuck
    in teardown (e.g. a process group destructor deadlocked on the GIL): its work is done,
    so it is killed and counted as exiting the way its result says (0 success, 1 error),
    instead of holding the whole job (the local controller and srun wait for every rank).

    A rank `watch` finds hung (no progress for longer than its phase allows) has its stacks
    dumped and is killed; `watch.record` then says so."""
    written_at: float | None = None
    peer_seen: tuple[float, dict[str, Any]] | None = None
    while True:
        try:
            return child.wait(timeout=1.0), False, None
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if peer_seen is None:
            found = peer()
            peer_seen = (time.monotonic(), found) if found else None
        if peer_seen is not None and (
            requeued(peer_seen[1]) or time.monotonic() - peer_seen[0] >= PEER_GRACE_S
        ):
            _say_peer_end(peer_seen[1])
            child.kill()
            return child.wait(), False, int(peer_seen[1].get("task", -1))
        if written_at is None:
            written_at = time.monotonic() if _written_since(result, since) else None
            # Not while a peer's end is about to end this rank: that is the cause, not a hang.
            judge = watch is not None and written_at is None and peer_seen is None
            stuck = watch.hung(child) if judge and watch is not None else None
            if stuck is not None and watch is not None:
                return watch.end(child, *stuck), False, None
            continue
        if time.monotonic() - written_at < HUNG_AFTER_RESULT_S:
            continue
        outcome = _outcome(result)
        if outcome is None:
            continue
        print(
            f"rank_guard: rank wrote its result ({outcome}) {HUNG_AFTER_RESULT_S:.0f} s ago but "
            "has not exited (stuck in teardown): killing it",
            file=sys.stderr,
            flush=True,
        )
        child.kill()
        child.wait()
        return (0 if outcome == "success" else 1), True, None


def requeued(record: dict[str, Any]) -> bool:
    """Whether a peer's exit record is the local executor's requeue of the attempt (rank 0
    checkpointed and asked for the next attempt): the other ranks end with it at once."""
    from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

    return record.get("returncode") == LOCAL_REQUEUE_RETURN_CODE


def _say_peer_end(record: dict[str, Any]) -> None:
    """The guard's line when it ends its rank for a peer's end."""
    task = record.get("task")
    if requeued(record):
        line = f"rank {task} requeued this attempt: this rank ends with it"
    else:
        how = record.get("signal") or f"exit code {record.get('returncode')}"
        line = (
            f"rank {task} of this job ended ({how}) {PEER_GRACE_S:.0f} s ago and this rank "
            "still runs: ending it instead of waiting for its collectives to time out"
        )
    print(f"rank_guard: {line}", file=sys.stderr, flush=True)


def _start(command: list[str], env: dict[str, str]) -> "subprocess.Popen[bytes]":
    """The rank, started as this guard's child."""
    # The rank is killed when this guard dies (e.g. the local controller's SIGKILL after a
    # cancel): no rank outlives its guard.
    return subprocess.Popen(command, preexec_fn=_die_with_guard, env=env)


def _die_with_guard() -> None:
    die_with_parent(signal.SIGKILL)


def main(command: list[str], peer_timeout_s: str) -> None:
    """Run `command` as this rank, record how it ended, and end the same way."""
    folder, job_id, task = identity()
    node = node_name()
    before = oom_kills()
    # The variable tasks.train.distributed.peer_timeout() reads (not imported: torch is heavy).
    started = time.time()
    watch = HangWatch(folder, job_id, task, started)
    env = {**os.environ, "TRAINFLOW_PEER_TIMEOUT_S": peer_timeout_s, **watch.env()}
    child = _start(command, env)
    _pass_on(child)
    where = {
        "task": task,
        "node": node,
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "pid": child.pid,
        "guard_pid": os.getpid(),
    }
    _write_json(folder / f"{job_id}_{task}_rank.json", where | {"started": started})
    returncode, hung, for_peer = _wait(
        child,
        folder / f"{job_id}_{task}_result.pkl",
        started,
        lambda: ended_peer(folder, job_id, task, started),
        watch,
    )
    after = oom_kills()
    ended = {
        "returncode": returncode,
        "signal": signal.Signals(-returncode).name if returncode < 0 else None,
        "oom_kill": returncode == -signal.SIGKILL
        and before is not None
        and after is not None
        and after > before,
        "ended": time.time(),
        "hung_after_result": hung,
        "ended_for_peer": for_peer,
        "hung": watch.record,
    }
    _write_json(folder / f"{job_id}_{task}_exit.json", where | ended)
    end_like(returncode)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 3 or args[0] != "--peer-timeout-s" or not args[1].isdigit():
        sys.exit("usage: python -m trainflow.cluster.rank_guard --peer-timeout-s S <command> ...")
    main(args[2:], args[1])
