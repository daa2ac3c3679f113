"""MLflow runs of a pipeline: one parent run, one child run per stage.

The flow creates the runs with an explicit client and passes run ids to the stages, so
nothing depends on MLflow's process-global "active run" (which a Slurm job never shares).
"""

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from trainflow.compat import mlflow_tracking_uri

# log_batch accepts at most 100 params per call.
_MAX_PARAMS = 100
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# The tag the MLflow UI's experiment-type selector writes. Without it MLflow 3.17 opens an
# experiment in its GenAI views (Traces, Evaluations); this value is its model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def ensure_experiment(client: MlflowClient, name: str, workdir: Path) -> str:
    """Id of the named experiment, created (artifacts under workdir for local stores).

    The experiment opens in the MLflow UI's model-training view (EXPERIMENT_KIND); one that
    has no kind yet (made by an older trainflow) gets it, a kind someone chose is kept.
    """
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return str(exp.experiment_id)
    local = client.tracking_uri.startswith(("sqlite:", "file:")) or "://" not in (
        client.tracking_uri
    )
    location = (workdir / "mlartifacts").resolve().as_uri() if local else None
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    return str(client.create_experiment(name, artifact_location=location, tags=tags))


def git_commit() -> str:
    """The code's git commit (with -dirty when the tree has changes), or 'unknown'."""
    try:
        sha = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True, timeout=10
    )
    return out.stdout.strip()


def create_run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    parent_id: str | None = None,
    tags: dict[str, str] | None = None,
) -> str:
    """Create a RUNNING run (a child when parent_id is given) and return its id."""
    all_tags = dict(tags or {})
    if parent_id:
        all_tags["mlflow.parentRunId"] = parent_id
    run = client.create_run(experiment_id, run_name=name, tags=all_tags)
    return str(run.info.run_id)


def log_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    """Log params in batches of at most 100 (MLflow's limit per call)."""
    items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), _MAX_PARAMS):
        client.log_batch(run_id, params=items[i : i + _MAX_PARAMS])


def set_tags(client: MlflowClient, run_id: str, tags: dict[str, str]) -> None:
    """Set several tags in one call."""
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def finish_run(client: MlflowClient, run_id: str, status: str = "FINISHED") -> None:
    """Mark a run FINISHED, FAILED or KILLED."""
    client.set_terminated(run_id, status=status)


def reopen_run(client: MlflowClient, run_id: str) -> None:
    """Mark an ended run RUNNING again, to continue it (its params, metrics and tags stay)."""
    client.update_run(run_id, status="RUNNING")


def log_metrics(client: MlflowClient, run_id: str, values: dict[str, float], step: int = 0) -> None:
    """Log several metrics in one call."""
    ts = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), ts, step) for k, v in values.items()])


@contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at `uri` for the block, then restore everything.

    `mlflow.set_tracking_uri` also writes MLFLOW_TRACKING_URI into os.environ (so that child
    processes inherit it). Left behind, that would send every later run of this process, and
    every process it starts (e.g. another pipeline's training ranks), to this run's store.
    """
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    try:
        with mlflow_tracking_uri(uri):  # and back to what this process had set, or to none
            yield
    finally:
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before
