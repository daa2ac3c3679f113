"""The sweep flow: one dataset, a grid of training configs as one job array, the best one
evaluated. MLflow: a parent run, a preprocess run, one train run per element, an evaluate run.
"""

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from trainflow.errors import JobError
from trainflow.flows.config import PipelineConfig, build_sweep, config_hash, flatten
from trainflow.flows.error_output import quiet_user_errors
from trainflow.flows.pipeline import (
    PipelineSummary,
    evaluate_stage,
    log_experiment,
    preprocess_stage,
    snapshot_code,
    summarize,
    timed,
    train_spec,
)
from trainflow.flows.preflight import preflight, user_modules
from trainflow.tasks.objectives import make_objective
from trainflow.tasks.preprocess.mlflow_dataset import log_dataset_input
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.train.checkpointing.checkpoint_tags import log_checkpoint
from trainflow.tasks.train.model_plugins import resolve_factory
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.monitor import monitor_for
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.sweep import best_element
from trainflow.tasks.train.task import train_array_task


class SweepSummary(PipelineSummary):
    """A pipeline summary plus the grid's outcome."""

    best_overrides: dict[str, Any]
    """The grid element that won (the objective's best validation metric: highest accuracy,
    lowest loss) and was evaluated."""
    val_accuracy: list[float | None]
    """Best validation accuracy per grid element (None: the element failed)."""


@flow(name="trainflow-sweep")
def sweep(
    preset: str | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    grid: dict[str, list[Any]] | None = None,
    experiment: str | None = None,
) -> SweepSummary:
    """Train every element of ``grid`` (e.g. {"train.lr": [1e-3, 3e-3]}) over the base config
    (preset, experiment file, overrides: as the pipeline's), evaluate the best."""
    quiet_user_errors()
    base, elements = build_sweep(preset, overrides or [], grid or {}, experiment)
    return run_sweep(base, elements, preflight(base, [cfg.train for _, cfg in elements]))


@flow(name="trainflow-sweep")
def checked_sweep(
    base: PipelineConfig,
    elements: list[tuple[dict[str, Any], PipelineConfig]],
    model: ModelReport,
    preset: str | None = None,
    overrides: list[str] | None = None,
    grid: dict[str, list[Any]] | None = None,
    experiment: str | None = None,
) -> SweepSummary:
    """The sweep of configs the caller built and checked (`trainflow sweep`); `preset`,
    `overrides`, `grid` and `experiment`, what the command was given, are shown with the flow
    run."""
    quiet_user_errors()
    return run_sweep(base, elements, model)


def run_sweep(
    base: PipelineConfig,
    elements: list[tuple[dict[str, Any], PipelineConfig]],
    model: ModelReport,
) -> SweepSummary:
    """The sweep body for validated and checked configs (must run inside a flow)."""
    modules = user_modules(base, model)
    modules += [resolve_factory(cfg.train).target.partition(":")[0] for _, cfg in elements]
    runs = PipelineRuns(base.tracking, base.workdir, f"{base.name}-sweep")
    grid_text = json.dumps([e for e, _ in elements])
    t: dict[str, float] = {}
    with runs.parent({**flatten(base), "sweep.grid": grid_text[:6000]}):
        log_experiment(runs, runs.parent_id, base)
        run_dir = (base.workdir / "runs" / runs.parent_id).resolve()
        code = snapshot_code(runs, modules, run_dir / "jobs")
        paths = code.paths if code else []
        dataset, cached = preprocess_stage(runs, base, t, paths)
        with timed(t, "train"):
            outcomes = _train_elements(runs, base, elements, dataset, paths)
        objective = make_objective(
            base.train.objective,
            dataset_spec(dataset, base.train.objective),
            base.train.objective_args,
        )
        monitor = monitor_for(base.train, objective)  # train.monitor: val_accuracy, val_loss...
        best = best_element(outcomes, monitor.metric, monitor.higher)
        best_ckpt = outcomes[best]
        assert isinstance(best_ckpt, CheckpointRef)
        element, best_cfg = elements[best]
        runs.tag(
            runs.parent_id,
            {"best_element": json.dumps(element), "config_hash": config_hash(best_cfg)},
        )
        get_run_logger().info("best element %d: %s", best, element)
        result = evaluate_stage(
            runs, best_cfg, dataset, best_ckpt, t, code.sha256 if code else None, paths
        )
    accuracies = [
        o.metrics.get("val_accuracy") if isinstance(o, CheckpointRef) else None for o in outcomes
    ]
    summary = summarize(runs, dataset, cached, result, t)
    return SweepSummary(**summary.model_dump(), best_overrides=element, val_accuracy=accuracies)


def _train_elements(
    runs: PipelineRuns,
    base: PipelineConfig,
    elements: list[tuple[dict[str, Any], PipelineConfig]],
    dataset: DatasetRef,
    code: list[Path],
) -> list[CheckpointRef | str]:
    """One train child run per element, all trained as one job array; runs closed per outcome."""
    run_dir = (base.workdir / "runs" / runs.parent_id).resolve()
    run_ids = [
        runs.open_stage(f"train[{i}]", {**flatten(cfg.train), "sweep.element": json.dumps(e)})
        for i, (e, cfg) in enumerate(elements)
    ]
    for run_id, (_, cfg) in zip(run_ids, elements, strict=True):
        log_dataset_input(runs.client, run_id, dataset, "training")
        log_experiment(runs, run_id, cfg)  # any element reruns as a pipeline of its own
    specs = [
        train_spec(cfg, dataset, run_dir / f"element-{i}", runs.tracking_uri, run_id, code)
        for i, ((_, cfg), run_id) in enumerate(zip(elements, run_ids, strict=True))
    ]
    try:
        outcomes = train_array_task(specs, base.cluster, run_dir / "jobs", base.workdir)
    except BaseException as exc:
        for run_id in run_ids:
            runs.close(run_id, exc)
        raise
    for run_id, outcome in zip(run_ids, outcomes, strict=True):
        if isinstance(outcome, CheckpointRef):
            log_checkpoint(runs.client, run_id, outcome)
            runs.close(run_id)
        else:
            runs.tag(run_id, {"error": outcome[:5000]})
            runs.close(run_id, JobError(outcome))
    if not any(isinstance(o, CheckpointRef) for o in outcomes):
        raise JobError("every sweep element failed:\n" + "\n".join(map(str, outcomes)))
    return outcomes
