"""A record of the jobs a flow process is watching, so orphans can be cancelled.

If the flow process is killed outright (SIGKILL, OOM, a lost node), nothing in it can cancel
its training job, and the job keeps its GPUs. Every submitted job is therefore recorded in
``<workdir>/active_jobs/<job id>.json`` with the watcher's pid and host, and removed when the
watcher is done with it. Each record has a watchdog (cluster.job_watchdog) that cancels the
job within a second of its watcher's death. A watcher whose own cancel the scheduler refused
(slurmctld did not answer) hands the cancel over to the watchdog (`hand_over`), which retries
it and keeps the record until the job is cancelled. A record whose watcher is gone, or whose
cancel was handed over, marks a job no watchdog may have taken care of (a lost host):
``trainflow cleanup`` (and the start of every pipeline run) cancels it.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

_DIR = "active_jobs"
_held: dict[str, Path] = {}
"""Job id -> the record this process wrote and has not forgotten (for `hand_over`)."""


@dataclass(frozen=True)
class ActiveJob:
    """One submitted job and the process watching it."""

    job_id: str
    executor: str
    folder: str
    owner_pid: int
    owner_host: str
    submitted_at: float
    watchdog_pid: int = 0
    """The job's cluster.job_watchdog process (0: none started)."""
    then: list[str] = field(default_factory=list)
    """A command the watchdog runs after it cancelled the job (e.g. marking MLflow runs
    KILLED): what the dead watcher would have done on its way out."""
    cancel_requested: str = ""
    """Why the watcher could not cancel the job itself; set, the watchdog cancels it now."""


def record_path(workdir: Path, job_id: str) -> Path:
    """Where the record of job `job_id` lives."""
    return workdir / _DIR / f"{job_id}.json"


def record(
    workdir: Path, job_id: str, executor: str, folder: Path, then: list[str] | None = None
) -> ActiveJob:
    """Write the record of a just-submitted job (atomically) and start its watchdog, which
    runs `then` after cancelling the job of a dead watcher."""
    job = ActiveJob(
        job_id, executor, str(folder), os.getpid(), socket.gethostname(), time.time(), 0, then or []
    )
    path = record_path(workdir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, job)  # before the watchdog starts: it watches this file
    job = replace(job, watchdog_pid=_start_watchdog(path, job.owner_pid))
    _write(path, job)
    _held[job_id] = path
    return job


def _start_watchdog(record: Path, owner_pid: int) -> int:
    """Start the watchdog (cluster.job_watchdog, a process of its own session) of the job
    recorded in `record`; its pid."""
    import trainflow

    root = Path(trainflow.__file__).resolve().parents[1]  # where `import trainflow` finds it
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainflow.cluster.job_watchdog", str(record), str(owner_pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    return proc.pid


@contextlib.contextmanager
def watching(
    workdir: Path, job_id: str, executor: str, folder: Path, then: list[str] | None = None
) -> Iterator[ActiveJob]:
    """The job recorded (`record`) while the body watches it, forgotten (`forget`) after."""
    job = record(workdir, job_id, executor, folder, then)
    try:
        yield job
    finally:
        forget(workdir, job_id)


def hand_over(job_id: str, why: str) -> bool:
    """Ask the watchdog of a job this process recorded to cancel it, `why` this process could
    not (the record then stays until the watchdog has); False when no record is held."""
    path = _held.pop(job_id, None)
    job = read(path) if path is not None else None
    if path is None or job is None:
        return False
    _write(path, replace(job, cancel_requested=why))
    return True


def _write(path: Path, job: ActiveJob) -> None:
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(job)))
    os.replace(tmp, path)


def forget(workdir: Path, job_id: str) -> None:
    """Remove a job's record once its watcher no longer needs it (its watchdog then exits);
    a record whose cancel was handed over stays for its watchdog."""
    _held.pop(job_id, None)
    path = record_path(workdir, job_id)
    job = read(path)
    if job is None or not job.cancel_requested:
        forget_record(path)


def forget_record(path: Path) -> None:
    """Remove the record at `path`."""
    path.unlink(missing_ok=True)


def read(path: Path) -> ActiveJob | None:
    """The record at `path`; None when it is gone or unreadable."""
    try:
        return ActiveJob(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def recorded(workdir: Path) -> list[ActiveJob]:
    """Every recorded job (unreadable records are skipped)."""
    jobs = [read(path) for path in sorted((workdir / _DIR).glob("*.json"))]
    return [job for job in jobs if job is not None]


def watcher_alive(job: ActiveJob) -> bool:
    """Whether the recording process still runs (records from other hosts count as alive)."""
    return job.owner_host != socket.gethostname() or pid_alive(job.owner_pid)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended; another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def cancel(job: ActiveJob) -> bool:
    """Cancel one job: scancel on Slurm (the job, or an allocation's training step); SIGINT to a
    local job's controller (it kills ranks). False when the scheduler did not take the cancel
    (scancel failed, e.g. slurmctld did not answer): worth trying again."""
    if job.executor == "slurm":
        return not scancel([job.job_id])
    if job.executor == "allocation":
        from trainflow.cluster.srun_executor import cancel_step

        cancel_step(job.job_id)
    elif _is_submitit_controller(job.job_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(job.job_id), signal.SIGINT)
    return True


def scancel(job_ids: list[str], timeout_s: float = 30.0) -> str:
    """scancel the jobs: "" when Slurm took the cancel (a job it no longer knows, purged, has
    nothing left to cancel), else why not (slurmctld did not answer, scancel missing, ...)."""
    try:
        out = subprocess.run(
            ["scancel", *job_ids], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"scancel got no answer in {timeout_s:.0f} s"
    except OSError as err:
        return f"scancel: {err}"
    if out.returncode == 0 or "Invalid job id" in out.stderr:
        return ""
    said = out.stderr.strip().splitlines()
    return said[-1] if said else f"scancel exited with {out.returncode}"


def _is_submitit_controller(pid: str) -> bool:
    # A local job id is its controller's pid: check it still is one before signalling it.
    try:
        return b"submitit" in Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def cancel_orphans(workdir: Path) -> list[tuple[ActiveJob, bool]]:
    """Cancel every recorded job whose watcher is gone or whose cancel was handed over: per
    job, whether the scheduler took the cancel. A cancelled job's record is forgotten and its
    `then` run (as its watchdog would have); a refused one's stays for the next try."""
    orphans = [job for job in recorded(workdir) if job.cancel_requested or not watcher_alive(job)]
    done = []
    for job in orphans:
        cancelled = cancel(job)
        if cancelled:
            forget_record(record_path(workdir, job.job_id))
            run_then(job)
        done.append((job, cancelled))
    return done


def log_path(job: ActiveJob) -> Path:
    """Where the job's watchdog (and cleanup) note what they did: its job folder."""
    return Path(job.folder) / f"{job.job_id}_watchdog.log"


def run_then(job: ActiveJob) -> str:
    """Run the record's follow-up command (if any), its output appended to `log_path(job)`;
    "" or why it failed."""
    if not job.then:
        return ""
    try:
        with log_path(job).open("a") as out:
            subprocess.run(job.then, stdout=out, stderr=subprocess.STDOUT, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the follow-up `{' '.join(job.then[1:4])} ...` failed: {err}"
    return ""
