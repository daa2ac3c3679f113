"""What a stage's MLflow run records about the Slurm job that ran it."""

import time
from collections.abc import Callable
from datetime import datetime

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from trainflow.cluster.accounting import job_accounting

# Text values become tags (searchable in the UI), numbers metrics; both under one prefix.
_PREFIX = "slurm_"


def log_accounting(client: MlflowClient, run_id: str, acct: dict[str, float | str]) -> None:
    """Numeric accounting values as metrics, state and job id as tags, in one log_batch."""
    ts = int(time.time() * 1000)
    metrics = [
        Metric(_PREFIX + k, float(v), ts, 0) for k, v in acct.items() if not isinstance(v, str)
    ]
    tags = [RunTag(_PREFIX + k, v) for k, v in acct.items() if isinstance(v, str)]
    client.log_batch(run_id, metrics=metrics, tags=tags)


def record_job_accounting(
    job_id: str,
    tracking_uri: str | None,
    run_id: str | None,
    log: Callable[[str], None],
    submitted_after: datetime | None = None,
) -> dict[str, float | str] | None:
    """Fetch a finished job's accounting, log it to the run (if any) and to `log`.

    Never raises: accounting is a report, and a failure here must not hide the job's own
    outcome (the caller is often about to re-raise the job's error). `submitted_after`: see
    cluster.accounting.job_accounting.
    """
    try:
        acct = job_accounting(job_id, submitted_after)
        if tracking_uri and run_id:
            log_accounting(MlflowClient(tracking_uri), run_id, acct)
    except Exception as exc:
        log(f"no Slurm accounting for job {job_id}: {type(exc).__name__}: {exc}")
        return None
    log(f"Slurm job {job_id}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in acct.items()))
    return acct


def _fmt(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.4g}"
