"""Prefect entry of the training stage: submit the job, forward its logs, wait."""

from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import submitit
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainflow.cluster import registry
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job, wait_for_jobs
from trainflow.cluster.lost_ranks import RankLostError
from trainflow.cluster.restarts import run_with_restarts
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.errors import ConfigError, JobError
from trainflow.tasks.diskspace import disk_stage, require_space
from trainflow.tasks.tracking import orphaned_runs
from trainflow.tasks.tracking.job_accounting import record_job_accounting
from trainflow.tasks.tracking.lost_ranks import record_lost_ranks
from trainflow.tasks.tracking.relay import relaying
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.epoch_progress import EpochProgress
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.parallel.layout import job_shape
from trainflow.tasks.train.ref import CheckpointRef


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train_task(
    spec: TrainJobSpec, cluster: ClusterConfig, job_dir: Path, workdir: Path, model: ModelReport
) -> CheckpointRef:
    """Run the training job on the configured executor and return its best checkpoint.

    `model`: what preflight found when it checked the model against the data (its size sets
    the disk space the checkpoints need). The job is recorded under workdir/active_jobs while
    it is watched, so that if this process dies, `trainflow cleanup` (or the next run) can
    still cancel it.
    """
    # A checkpoint holds weights and two Adam moments; two of them and best.pt may coexist.
    need = 4 * model.parameters * 7
    require_space("train", spec.out_dir, need)  # before the job is queued
    logger = get_run_logger()
    check_cluster(cluster)
    progress = EpochProgress(spec.out_dir / "checkpoints", spec.train.epoch_limit, logger.warning)
    with disk_stage("train", spec.out_dir, need):
        ref = train_with_restarts(
            spec, cluster, job_dir, workdir, progress.watching(logger.info), logger.warning, need
        )
    progress.finish()
    if not isinstance(ref, CheckpointRef):
        raise JobError(f"the training job returned no checkpoint (got {ref!r})")
    return ref


@task(name="train-array", cache_policy=NO_CACHE, persist_result=False)
def train_array_task(
    specs: list[TrainJobSpec], cluster: ClusterConfig, job_dir: Path, workdir: Path
) -> list[CheckpointRef | str]:
    """Train every spec as one job array (their models checked by preflight); per element its
    checkpoint or its error text."""
    logger = get_run_logger()
    check_cluster(cluster)
    jobs = submit_array(specs, cluster, job_dir)
    ids = [str(job.job_id) for job in jobs]
    logger.info("submitted %d training jobs as one array: %s", len(jobs), ", ".join(ids))
    since = datetime.now() - timedelta(minutes=1)  # see _wait_and_account
    with ExitStack() as watched:
        for job_id, spec in zip(ids, specs, strict=True):
            then = _mark_killed_then(spec)
            watched.enter_context(
                registry.watching(workdir, job_id, cluster.executor, job_dir, then=then)
            )
        with ExitStack() as relays:
            for spec in specs:
                relays.enter_context(
                    relaying(spec.out_dir, spec.tracking_uri, spec.run_id, logger.info)
                )
            outcomes = wait_for_jobs(jobs, logger.info)
    if cluster.executor == "slurm":
        for job_id, spec in zip(ids, specs, strict=True):
            record_job_accounting(job_id, spec.tracking_uri, spec.run_id, logger.info, since)
    return [o if isinstance(o, CheckpointRef) else str(o) for o in outcomes]


def submit_array(
    specs: list[TrainJobSpec],
    cluster: ClusterConfig,
    job_dir: Path,
    job: Callable[[TrainJobSpec], TrainingJob] = TrainingJob,
) -> list[submitit.Job[Any]]:
    """Submit `job(spec)` for every spec as one job array on the configured executor (as
    map_array, but each element a callable of its own). An element is a training job like a
    single one: requeued at every time limit, only its attempts without a new checkpoint
    counted against cluster.max_requeues (tasks.train.limits.limit_requeue)."""
    executor = make_executor(cluster, job_dir)
    with executor.batch():
        jobs = [executor.submit(job(spec)) for spec in specs]
    return jobs


def train_with_restarts(
    spec: TrainJobSpec,
    cluster: ClusterConfig,
    job_dir: Path,
    workdir: Path,
    log: Callable[[str], None],
    warn: Callable[[str], None],
    need: int = 0,
) -> Any:
    """Submit the training job and wait for it; after a lost rank, submit it again from its
    last checkpoint (cluster.restarts), each loss named in `warn` and on the MLflow run; an
    fsdp job continues on the nodes left when the others cannot hold it whole.
    `need`: bytes the job's pickle may take, for a clear disk-full error (tasks.diskspace).
    The job's ranks journal what they log for the train run; this process sends it, while the
    job runs and what is left at its end (tasks.tracking.relay): TrackingUnavailable when the
    server is gone then."""

    def submit(exclude: list[str], nodes: int) -> submitit.Job[Any]:
        sized = cluster if nodes == cluster.nodes else cluster.model_copy(update={"nodes": nodes})
        executor = make_executor(sized, job_dir)
        if exclude:
            executor.update_parameters(exclude=",".join(exclude))
        with disk_stage("train", job_dir, need):  # the job's pickle
            job = executor.submit(TrainingJob(spec))
        log(f"submitted training job {job.job_id} ({cluster.executor} executor)")
        return job

    then = _mark_killed_then(spec)

    def wait(job: submitit.Job[Any]) -> Any:
        with registry.watching(workdir, str(job.job_id), cluster.executor, job_dir, then=then):
            return _wait_and_account(job, spec, cluster, log)

    def on_loss(err: RankLostError, attempt: int) -> None:
        record_lost_ranks(spec.tracking_uri, spec.run_id, err, attempt, warn)

    with relaying(spec.out_dir, spec.tracking_uri, spec.run_id, log):
        return run_with_restarts(cluster, submit, wait, log, on_loss, partial(admits, spec.train))


def admits(train: TrainConfig, ranks: int) -> bool:
    """Whether a job of `train` can continue on `ranks` ranks after losing some: under fsdp
    (its checkpoints load on any number of ranks) where train.parallel's mesh makes them up."""
    if train.strategy != "fsdp":
        return False
    try:
        job_shape(train.strategy, train.parallel, ranks)
    except ConfigError:
        return False
    return True


def _mark_killed_then(spec: TrainJobSpec) -> list[str] | None:
    """What the job's watchdog runs after cancelling the job of a dead flow process: its train
    run (and parent) marked KILLED, as this process would have on its way out."""
    uri, run_id = spec.tracking_uri, spec.run_id
    return orphaned_runs.command(uri, run_id) if uri and run_id else None


def _wait_and_account(
    job: submitit.Job[Any], spec: TrainJobSpec, cluster: ClusterConfig, log: Callable[[str], None]
) -> Any:
    """wait_for_job; then, for Slurm, log what the job cost to the train run, success or not."""
    if cluster.executor != "slurm":
        return wait_for_job(job, log)
    # Just after sbatch returned; a minute of slack for the controller's clock. Older jobs
    # with this id (a wiped dev cluster restarts ids at 1) were submitted before it.
    since = datetime.now() - timedelta(minutes=1)
    try:
        ref = wait_for_job(job, log)
    except Exception:
        # Never raises, so the job's own error propagates. Interrupts (BaseException) skip
        # this: a cancellation must not wait for sacct.
        record_job_accounting(str(job.job_id), spec.tracking_uri, spec.run_id, log, since)
        raise
    record_job_accounting(str(job.job_id), spec.tracking_uri, spec.run_id, log, since)
    return ref
