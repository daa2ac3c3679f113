"""The pipeline flow: preprocess -> train -> evaluate, one MLflow parent run, a child per stage.

Composes stages only; all work happens in tasks/ and cluster/.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.config import PipelineConfig, build_config, flatten
from tasks.evaluate.task import evaluate_task
from tasks.preprocess.task import preprocess
from tasks.tracking.pipeline_runs import PipelineRuns
from tasks.tracking.stage_logs import log_checkpoint, log_dataset
from tasks.train.job import TrainJobSpec
from tasks.train.task import train_task


class PipelineSummary(BaseModel):
    """The small result of a pipeline run: where to look and the headline number."""

    model_config = ConfigDict(frozen=True)

    test_accuracy: float
    experiment: str
    parent_run_id: str
    tracking_uri: str
    dataset_hash: str
    preprocess_cached: bool
    stage_seconds: dict[str, float]
    model_uri: str | None


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 2)


@flow(name="trainflow-pipeline")
def pipeline(
    preset: str = "demo", overrides: dict[str, Any] | list[str] | None = None
) -> PipelineSummary:
    """Run the whole pipeline for a preset plus dotted overrides (e.g. train.epochs=3)."""
    return run_pipeline(build_config(preset, overrides or []))


def run_pipeline(cfg: PipelineConfig) -> PipelineSummary:
    """The pipeline body for an already validated config (must run inside a flow)."""
    log = get_run_logger()
    runs = PipelineRuns(cfg.tracking, cfg.workdir, cfg.name)
    run_dir = (cfg.workdir / "runs" / runs.parent_id).resolve()
    t: dict[str, float] = {}
    log.info("MLflow parent run %s in %s", runs.parent_id, runs.tracking_uri)
    with runs.parent(flatten(cfg)) as parent_id:
        with runs.stage("preprocess", flatten(cfg.preprocess)) as run_id, _timed(t, "preprocess"):
            dataset, cached = preprocess(cfg.preprocess, cfg.cluster.dask, cfg.workdir / "datasets")
            log_dataset(runs.client, run_id, dataset, cached)
        runs.tag(parent_id, {"dataset_hash": dataset.content_hash})
        with runs.stage("train", flatten(cfg.train)) as run_id, _timed(t, "train"):
            spec = TrainJobSpec(
                train=cfg.train,
                dataset=dataset,
                out_dir=run_dir,
                cpus_per_task=cfg.cluster.cpus_per_task,
                tracking_uri=runs.tracking_uri,
                run_id=run_id,
            )
            ckpt = train_task(spec, cfg.cluster, run_dir / "jobs")
            log_checkpoint(runs.client, run_id, ckpt)
        with runs.stage("evaluate", flatten(cfg.evaluate)) as run_id, _timed(t, "evaluate"):
            result = evaluate_task(
                cfg.evaluate, cfg.train, dataset, ckpt, runs.tracking_uri, run_id
            )
        runs.log_summary(
            parent_id,
            {"test_accuracy": result.test_accuracy, **{f"seconds_{k}": v for k, v in t.items()}},
        )
    log.info("test accuracy %.4f (stage seconds: %s)", result.test_accuracy, t)
    return PipelineSummary(
        test_accuracy=result.test_accuracy,
        experiment=runs.experiment,
        parent_run_id=runs.parent_id,
        tracking_uri=runs.tracking_uri,
        dataset_hash=dataset.content_hash,
        preprocess_cached=cached,
        stage_seconds=t,
        model_uri=result.model_uri,
    )
