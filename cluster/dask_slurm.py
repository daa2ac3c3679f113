"""dask workers as Slurm jobs (cluster.dask.executor=slurm), through dask-jobqueue's SLURMCluster.

The scheduler runs in the flow's process, listening on an address the compute nodes reach;
each worker is one single-node Slurm job named ``trainflow-dask-<id>``: a plain dask worker, or
dask-cuda-worker (one worker per GPU) when the job gets GPUs. The request is checked against
the cluster before anything is queued; we wait for every worker with a timeout and, when one
does not start, say why (squeue's reason, or the tail of its log). However the block ends
(normally, on an error, Ctrl-C or a Prefect cancel), every worker job is cancelled: by job id
through SLURMCluster.close and then by the cluster's unique job name, which also catches a
job whose sbatch was still under way. A flow process killed outright cannot cancel anything:
its jobs are recorded in the workdir's registry (cluster.registry) for `trainflow cleanup`, and
its workers exit after DEATH_TIMEOUT_S without a scheduler, which ends their jobs anyway.
"""

import logging
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import distributed

from trainflow.cluster import registry
from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask_slurm_checks import check_dask_workers, worker_mem_mb
from trainflow.compat import import_slurm_cluster, start_requested_workers
from trainflow.errors import ConfigError, JobError

Backend = Literal["numpy", "cupy"]
log = logging.getLogger(__name__)

DEATH_TIMEOUT_S = 60
"""Seconds a worker waits for a lost scheduler before it exits (and so its job ends)."""
# Pending reasons that never resolve by waiting: fail at once instead of at the timeout.
HOPELESS_REASONS = frozenset(
    {
        "PartitionTimeLimit",
        "PartitionNodeLimit",
        "PartitionConfig",
        "InvalidAccount",
        "InvalidQOS",
        "BadConstraints",
        "QOSMaxWallDurationPerJobLimit",
        "AccountNotAllowed",
    }
)
_POLL_S = 1.0


@dataclass(frozen=True)
class QueuedJob:
    """One worker job as squeue shows it."""

    job_id: str
    state: str
    reason: str
    nodes: str


@contextmanager
def slurm_client(
    cfg: DaskConfig, workdir: Path, env: Mapping[str, object] | None = None, record: bool = True
) -> Iterator[tuple[distributed.Client, Backend]]:
    """Start cfg.n_workers worker jobs, wait for them, yield a client; cancel every job on exit.

    Worker logs go to workdir/dask-workers; with ``record`` each job is also recorded in
    workdir/active_jobs while it runs (cluster.registry: `trainflow cleanup` cancels the jobs
    of a flow process that was killed). ``env``: variables exported in each worker job.
    """
    check_dask_workers(cfg)  # before anything is queued
    SLURMCluster = import_slurm_cluster()
    name = f"trainflow-dask-{uuid.uuid4().hex[:8]}"
    log_dir = workdir / "dask-workers"
    cluster = SLURMCluster(**cluster_options(cfg, name, log_dir, env or {}))
    ids: list[str] = []
    try:
        try:
            submit_workers(cluster, cfg.n_workers)
        finally:
            ids = [str(job.job_id) for job in cluster.workers.values() if job.job_id]
            for job_id in ids if record else []:
                registry.record(workdir, job_id, "slurm", log_dir)
        with distributed.Client(cluster) as client:
            wait_for_workers(client, cluster, cfg, name, log_dir)
            yield client, "cupy" if cfg.gpus_per_worker else "numpy"
    finally:
        try:
            cluster.close(timeout=30)
        # A worker whose sbatch failed fails close()'s own status assertion: the jobs are
        # cancelled below all the same, and the error that brought us here must not be hidden.
        except Exception as err:
            log.info("closing the dask worker cluster: %s: %s", type(err).__name__, err)
        finally:
            refused = cancel_worker_jobs(name, ids)
            for job_id in ids if record else []:
                if refused:  # slurmctld did not answer: the jobs' watchdogs keep trying
                    registry.hand_over(job_id, refused)
                registry.forget(workdir, job_id)


def submit_workers(cluster: Any, n: int) -> None:
    """Queue n worker jobs now; JobError with sbatch's own words when it refuses one.

    SpecCluster.scale only schedules the submission on the cluster's event loop, where a
    failing sbatch is logged as a traceback and the worker silently never comes.
    """
    while len(cluster.worker_spec) < n:
        cluster.worker_spec.update(cluster.new_worker_spec())
    try:
        start_requested_workers(cluster)
    except RuntimeError as err:  # dask-jobqueue's: the command, its exit code, stdout, stderr
        why = " ".join(str(err).rpartition("stderr:")[2].split()) or str(err)
        raise JobError(
            f"sbatch refused a dask worker job: {why}; check cluster.dask.partition, account "
            "and sbatch_extra"
        ) from None


def cluster_options(
    cfg: DaskConfig, name: str, log_dir: Path, env: Mapping[str, object]
) -> dict[str, Any]:
    """SLURMCluster's keyword arguments for cfg: one worker (process) per single-node job."""
    gpu = cfg.gpus_per_worker > 0
    extra = [f"--{key}={value}" for key, value in cfg.sbatch_extra.items()]
    if gpu:
        extra.append(f"--gres=gpu:{cfg.gpus_per_worker}")
    return {
        "job_name": name,
        "queue": cfg.partition,
        "account": cfg.account,
        "walltime": slurm_time(cfg.timeout_min),
        "cores": cfg.threads_per_worker,
        "processes": 1,
        "job_cpu": cfg.cpus_per_worker,
        "memory": f"{worker_mem_mb(cfg)}MiB",
        "job_mem": f"{worker_mem_mb(cfg)}M",
        "job_extra_directives": extra,
        "job_script_prologue": [f"export {key}={value}" for key, value in env.items()],
        # dask-cuda-worker starts one worker per GPU of the job (CUDA_VISIBLE_DEVICES from Slurm).
        "worker_command": "dask_cuda.cli" if gpu else "distributed.cli.dask_worker",
        "death_timeout": DEATH_TIMEOUT_S,
        "log_directory": str(log_dir),
        "scheduler_options": {
            "host": cfg.scheduler_host or scheduler_host(),
            "dashboard_address": ":0",
        },
        "silence_logs": "warning",
    }


def scheduler_host() -> str:
    """This host's address as its name resolves: what compute nodes use to reach it."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as err:
        raise ConfigError(
            f"this host's name {name!r} does not resolve ({err}): set cluster.dask.scheduler_host"
            " to an address of this machine that the compute nodes reach"
        ) from None


def slurm_time(minutes: int) -> str:
    """A time limit in Slurm's days-hours:minutes:seconds form."""
    return f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"


def wait_for_workers(
    client: distributed.Client,
    cluster: Any,
    cfg: DaskConfig,
    name: str,
    log_dir: Path,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once every worker job has a connected worker; JobError saying why otherwise."""
    deadline = clock() + cfg.start_timeout_s
    while True:
        jobs = {str(job.job_id): spec for spec, job in cluster.workers.items()}
        connected = _connected_jobs(client, jobs)
        if len(connected) >= cfg.n_workers:
            queued = squeue_jobs(name)
            where = ", ".join(f"{j} on {queued[j].nodes}" for j in sorted(queued))
            log.info("dask: %d Slurm worker job(s) running: %s", len(connected), where)
            return
        queued = squeue_jobs(name)
        _fail_if_hopeless(jobs, connected, queued, name, log_dir)
        if clock() > deadline:
            raise JobError(_not_started(cfg, jobs, connected, queued, name, log_dir, cluster))
        time.sleep(_POLL_S)


def _connected_jobs(client: distributed.Client, jobs: dict[str, str]) -> set[str]:
    """Job ids with a worker at the scheduler (dask-cuda names its workers <spec>-<gpu>)."""
    workers = client.scheduler_info(n_workers=-1).get("workers", {})
    names = {str(w.get("name")) for w in workers.values()}
    return {
        job_id
        for job_id, spec in jobs.items()
        if any(n == spec or n.startswith(f"{spec}-") for n in names)
    }


def _fail_if_hopeless(
    jobs: dict[str, str],
    connected: set[str],
    queued: dict[str, QueuedJob],
    name: str,
    log_dir: Path,
) -> None:
    """JobError at once for a job that ended without a worker, or pends for a lasting reason."""
    for job_id in sorted(set(jobs) - connected):
        job = queued.get(job_id)
        if job is None:
            raise JobError(
                f"dask worker job {job_id} ended before its worker connected; the end of its "
                f"log:\n{_log_tail(log_dir, name, job_id)}"
            )
        if job.state == "PENDING" and job.reason in HOPELESS_REASONS:
            raise JobError(
                f"dask worker job {job_id} can never start (squeue reason {job.reason}): fix "
                "cluster.dask.partition, account, timeout_min or the per-worker resources"
            )


def _not_started(
    cfg: DaskConfig,
    jobs: dict[str, str],
    connected: set[str],
    queued: dict[str, QueuedJob],
    name: str,
    log_dir: Path,
    cluster: Any,
) -> str:
    """The timeout's message: each missing job's state and squeue reason."""
    lines = []
    for job_id in sorted(set(jobs) - connected):
        job = queued.get(job_id)
        if job is None:
            lines.append(f"job {job_id}: not in squeue")
        elif job.state == "PENDING":
            lines.append(f"job {job_id}: PENDING, reason {job.reason}")
        else:
            lines.append(
                f"job {job_id}: {job.state} on {job.nodes} but its worker did not connect to "
                f"{cluster.scheduler_address} (set cluster.dask.scheduler_host to an address "
                f"the nodes reach); its log:\n{_log_tail(log_dir, name, job_id)}"
            )
    return (
        f"{cfg.n_workers - len(connected)} of {cfg.n_workers} dask worker job(s) did not start "
        f"within cluster.dask.start_timeout_s={cfg.start_timeout_s}: "
        + "; ".join(lines)
        + " (Resources/Priority: the cluster is busy, raise start_timeout_s or ask for less; "
        "the worker jobs were cancelled)"
    )


def _log_tail(log_dir: Path, name: str, job_id: str, chars: int = 2000) -> str:
    path = log_dir / f"{name}-{job_id}.err"
    try:
        return path.read_text(errors="replace")[-chars:] or f"({path} is empty)"
    except OSError:
        return f"(no log at {path})"


def squeue_jobs(name: str) -> dict[str, QueuedJob]:
    """The queued or running jobs named ``name``, by job id (one squeue call for all)."""
    out = subprocess.run(
        ["squeue", "-h", "--name", name, "-o", "%i|%T|%r|%N"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise JobError(f"squeue failed while waiting for the dask workers: {out.stderr.strip()}")
    jobs = {}
    for line in out.stdout.splitlines():
        job_id, state, reason, nodes = [*line.split("|"), "", "", ""][:4]
        jobs[job_id] = QueuedJob(job_id, state, reason, nodes)
    return jobs


def cancel_worker_jobs(name: str, job_ids: list[str]) -> str:
    """scancel the given jobs and every job named ``name``; never raises: "" or why the
    scheduler did not take the cancel (each refusal also logged)."""
    refused = ""
    for argv in ([*job_ids] if job_ids else None, ["--name", name]):
        if argv is None:
            continue
        why = registry.scancel(argv, timeout_s=60)
        if why:
            log.warning("could not cancel dask worker jobs (scancel %s): %s", " ".join(argv), why)
            refused = refused or why
    return refused


def worker_placement(client: distributed.Client) -> str:
    """Where each worker runs, as its own environment says: 'job 12 on tfnode1, ...'."""

    def where() -> str:
        import os  # runs on the worker

        job, node = os.environ.get("SLURM_JOB_ID", "?"), os.environ.get("SLURMD_NODENAME", "?")
        return f"job {job} on {node}"

    return ", ".join(sorted(client.run(where).values()))
