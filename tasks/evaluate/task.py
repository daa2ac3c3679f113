"""Prefect entry of the evaluation stage."""

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainflow.tasks.diskspace import disk_stage, require_space
from trainflow.tasks.evaluate.config import EvaluateConfig
from trainflow.tasks.evaluate.run import EvalResult, run_evaluate
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.ref import CheckpointRef


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def evaluate_task(
    cfg: EvaluateConfig,
    train: TrainConfig,
    dataset: DatasetRef,
    ckpt: CheckpointRef,
    tracking_uri: str,
    run_id: str,
    version_tags: dict[str, str],
    code: list[Path] | None = None,
) -> EvalResult:
    """Test metrics, plots, the logged model and its registered version for the best checkpoint."""
    # The logged model is a copy of the best weights; plots and metrics are small.
    need = 2 * ckpt.path.stat().st_size
    require_space("evaluate", ckpt.path.parent, need)  # before the model is exported
    with disk_stage("evaluate", ckpt.path.parent, need):
        say = get_run_logger().info
        return run_evaluate(
            cfg, train, dataset, ckpt, tracking_uri, run_id, version_tags, say, code or []
        )
