"""A small process per watched job that cancels the job the moment its watcher dies.

The flow process that submitted a job cancels it when it is interrupted (Ctrl-C, a Prefect
cancel, an error). Killed outright (SIGKILL, the OOM killer, a runner that gives up on a flow
process that does not end on SIGTERM) it can do nothing, and the job would train on until
``trainflow cleanup`` or the next pipeline run found its record (cluster.registry). This
watchdog closes that gap: registry.record runs ``python -m trainflow.cluster.job_watchdog`` in
a session of its own (a terminal's Ctrl-C, a runner's process-group kill do not reach it). It
waits for the watcher to end (a pidfd where Linux has one, else a poll) and:

- the job's record gone (the watcher finished with the job and forgot it): exits;
- the watcher gone and the record still there, or the cancel handed over to it (the watcher's
  own scancel refused: registry.hand_over): cancels the job (registry.cancel, retried while
  the scheduler does not answer), forgets the record, says so on the stderr it inherited and
  in ``<job folder>/<job id>_watchdog.log``, then runs the record's `then` command (the train
  stage's marks its MLflow runs KILLED: tasks.tracking.orphaned_runs), its output in that log.

``trainflow cleanup`` remains for what a watchdog cannot outlive: a lost host, or a watchdog
killed with its watcher.
"""

import os
import select
import sys
import time
from pathlib import Path

from trainflow.cluster import registry

POLL_S = 0.5
"""How often the record is checked (and, without a pidfd, the watcher's liveness)."""
CANCEL_TRIES = 5
"""scancel attempts (2 s apart) before the record is left for `trainflow cleanup`."""


def _wait_for_exit(pid: int, record: Path) -> str:
    """Block until `pid` has ended ("ended"), `record` is gone ("forgotten") or the cancel was
    handed over in it ("handed over")."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel), or the watcher already gone
        pidfd = None
    seen: tuple[int, int] | None = None
    try:
        while True:
            try:
                stat = record.stat()
            except FileNotFoundError:
                return "forgotten"
            if (stat.st_ino, stat.st_mtime_ns) != seen:  # rewritten (atomically): read it
                seen = (stat.st_ino, stat.st_mtime_ns)
                if _handed_over(record):
                    return "handed over"
            if pidfd is not None:
                ready, _, _ = select.select([pidfd], [], [], POLL_S)
                if ready:
                    return "ended"
            elif not registry.pid_alive(pid):
                return "ended"
            else:
                time.sleep(POLL_S)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _handed_over(record: Path) -> bool:
    job = registry.read(record)
    return job is not None and bool(job.cancel_requested)


def _say(line: str, log: Path) -> None:
    """`line` on the inherited stderr and in the log."""
    print(f"trainflow: {line}", file=sys.stderr, flush=True)
    _note(line, log)


def _note(line: str, log: Path) -> None:
    """`line` in the log only."""
    try:
        with log.open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
    except OSError:
        pass


def main(argv: list[str]) -> int:
    """Watch the watcher of the job recorded at argv[0] (pid argv[1])."""
    record, owner = Path(argv[0]), int(argv[1])
    if _wait_for_exit(owner, record) == "forgotten":
        return 0
    job = registry.read(record)
    if job is None or job.owner_pid != owner:
        return 0  # forgotten as the watcher ended, or recorded again by another watcher
    log = registry.log_path(job)
    what = f"the flow process {owner} that watched {job.executor} job {job.job_id}"
    what += (
        f" could not cancel it ({job.cancel_requested})"
        if job.cancel_requested
        else " ended without cancelling it (killed?)"
    )
    for attempt in range(CANCEL_TRIES):
        if attempt:
            _note(f"the scheduler did not take the cancel of job {job.job_id} (try {attempt})", log)
            time.sleep(2.0)
        if registry.cancel(job):
            registry.forget_record(record)
            _say(f"{what}: cancelled it", log)
            failed = registry.run_then(job)
            if failed:
                _say(failed, log)
            return 0
    _say(
        f"{what}, and the job could not be cancelled: run `trainflow cleanup` "
        f"(or scancel {job.job_id}) once the scheduler answers",
        log,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
