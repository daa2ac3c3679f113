"""Prefect entry of the training stage: submit the job, forward its logs, wait."""

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from cluster.config import ClusterConfig
from cluster.executor import make_executor
from cluster.jobs import wait_for_job
from tasks.errors import JobError
from tasks.train.job import TrainingJob, TrainJobSpec
from tasks.train.models import build_model
from tasks.train.ref import CheckpointRef


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train_task(spec: TrainJobSpec, cluster: ClusterConfig, job_dir: Path) -> CheckpointRef:
    """Run the training job on the configured executor and return its best checkpoint."""
    logger = get_run_logger()
    # Model/data mismatches (e.g. images too small) fail here, before anything is queued.
    build_model(spec.train, spec.dataset.shape, len(spec.dataset.classes))
    executor = make_executor(cluster, job_dir)
    job = executor.submit(TrainingJob(spec))
    logger.info("submitted training job %s (%s executor)", job.job_id, cluster.executor)
    ref = wait_for_job(job, logger.info)
    if not isinstance(ref, CheckpointRef):
        raise JobError(f"training job {job.job_id} returned no checkpoint (got {ref!r})")
    return ref
