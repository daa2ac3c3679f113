"""A record of the jobs a flow process is watching, so orphans can be cancelled.

If the flow process is killed outright (SIGKILL, OOM, a lost node), nothing in it can cancel
its training job, and the job keeps its GPUs. Every submitted job is therefore recorded in
``<workdir>/active_jobs/<job id>.json`` with the watcher's pid and host, and removed when the
watcher is done with it. A record whose watcher is gone marks an orphan: ``trainflow
cleanup`` (and the start of every pipeline run) cancels it.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_DIR = "active_jobs"


@dataclass(frozen=True)
class ActiveJob:
    """One submitted job and the process watching it."""

    job_id: str
    executor: str
    folder: str
    owner_pid: int
    owner_host: str
    submitted_at: float


def _path(workdir: Path, job_id: str) -> Path:
    return workdir / _DIR / f"{job_id}.json"


def record(workdir: Path, job_id: str, executor: str, folder: Path) -> ActiveJob:
    """Write the record of a just-submitted job (atomically)."""
    job = ActiveJob(job_id, executor, str(folder), os.getpid(), socket.gethostname(), time.time())
    path = _path(workdir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(job)))
    os.replace(tmp, path)
    return job


def forget(workdir: Path, job_id: str) -> None:
    """Remove a job's record once its watcher no longer needs it."""
    _path(workdir, job_id).unlink(missing_ok=True)


def recorded(workdir: Path) -> list[ActiveJob]:
    """Every recorded job (unreadable records are skipped)."""
    jobs = []
    for path in sorted((workdir / _DIR).glob("*.json")):
        try:
            jobs.append(ActiveJob(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return jobs


def watcher_alive(job: ActiveJob) -> bool:
    """Whether the recording process still runs (records from other hosts count as alive)."""
    if job.owner_host != socket.gethostname():
        return True
    try:
        os.kill(job.owner_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(job.owner_pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def cancel(job: ActiveJob) -> None:
    """Cancel one job: scancel on Slurm (the job, or an allocation's training step); SIGINT to a
    local job's controller (it kills ranks)."""
    if job.executor == "slurm":
        subprocess.run(["scancel", job.job_id], check=False, capture_output=True, timeout=30)
    elif job.executor == "allocation":
        from trainflow.cluster.srun_executor import cancel_step

        cancel_step(job.job_id)
    elif _is_submitit_controller(job.job_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(job.job_id), signal.SIGINT)


def _is_submitit_controller(pid: str) -> bool:
    # A local job id is its controller's pid: check it still is one before signalling it.
    try:
        return b"submitit" in Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def cancel_orphans(workdir: Path) -> list[ActiveJob]:
    """Cancel and forget every recorded job whose watcher is gone; returns them."""
    orphans = [job for job in recorded(workdir) if not watcher_alive(job)]
    for job in orphans:
        cancel(job)
        forget(workdir, job.job_id)
    return orphans
