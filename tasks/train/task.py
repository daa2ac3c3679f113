"""Prefect entry of the training stage: submit the job, forward its logs, wait."""

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from cluster import registry
from cluster.config import ClusterConfig
from cluster.executor import make_executor
from cluster.jobs import wait_for_job, wait_for_jobs
from tasks.errors import JobError
from tasks.train.job import TrainingJob, TrainJobSpec
from tasks.train.models import build_model
from tasks.train.ref import CheckpointRef
from tasks.train.sweep import ArrayTrainingJob


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train_task(
    spec: TrainJobSpec, cluster: ClusterConfig, job_dir: Path, workdir: Path
) -> CheckpointRef:
    """Run the training job on the configured executor and return its best checkpoint.

    The job is recorded under workdir/active_jobs while it is watched, so that if this
    process dies, `trainflow cleanup` (or the next run) can still cancel it.
    """
    logger = get_run_logger()
    # Model/data mismatches (e.g. images too small) fail here, before anything is queued.
    build_model(spec.train, spec.dataset.shape, len(spec.dataset.classes))
    executor = make_executor(cluster, job_dir)
    job = executor.submit(TrainingJob(spec))
    logger.info("submitted training job %s (%s executor)", job.job_id, cluster.executor)
    registry.record(workdir, str(job.job_id), cluster.executor, job_dir)
    try:
        ref = wait_for_job(job, logger.info)
    finally:
        registry.forget(workdir, str(job.job_id))
    if not isinstance(ref, CheckpointRef):
        raise JobError(f"training job {job.job_id} returned no checkpoint (got {ref!r})")
    return ref


@task(name="train-array", cache_policy=NO_CACHE, persist_result=False)
def train_array_task(
    specs: list[TrainJobSpec], cluster: ClusterConfig, job_dir: Path, workdir: Path
) -> list[CheckpointRef | str]:
    """Train every spec as one job array; per element its checkpoint or its error text."""
    logger = get_run_logger()
    for spec in specs:
        build_model(spec.train, spec.dataset.shape, len(spec.dataset.classes))
    executor = make_executor(cluster, job_dir)
    jobs = executor.map_array(ArrayTrainingJob(), specs)
    ids = [str(job.job_id) for job in jobs]
    logger.info("submitted %d training jobs as one array: %s", len(jobs), ", ".join(ids))
    for job_id in ids:
        registry.record(workdir, job_id, cluster.executor, job_dir)
    try:
        outcomes = wait_for_jobs(jobs, logger.info)
    finally:
        for job_id in ids:
            registry.forget(workdir, job_id)
    return [o if isinstance(o, CheckpointRef) else str(o) for o in outcomes]
