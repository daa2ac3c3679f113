"""The pipeline flow: preprocess -> train -> evaluate, one MLflow parent run, a child per stage.

Composes stages only; all work happens in tasks/ and cluster/.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, ConfigDict

from trainflow.cluster.registry import cancel_orphans
from trainflow.cluster.snapshot import CodeSnapshot, snapshot_for_jobs
from trainflow.flows import experiment
from trainflow.flows.config import PipelineConfig, build_config, config_hash, flatten
from trainflow.flows.error_output import quiet_user_errors
from trainflow.flows.preflight import initial_weights, preflight, user_modules
from trainflow.flows.report import run_link, runs_and_plots_markdown, summary_markdown
from trainflow.flows.run_record import new_record, update_record
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.ref import CheckpointRef

if TYPE_CHECKING:
    from trainflow.tasks.evaluate.run import EvalResult
    from trainflow.tasks.tracking.lineage import Lineage
    from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
    from trainflow.tasks.train.job import TrainJobSpec


class PipelineSummary(BaseModel):
    """The small result of a pipeline run: where to look and the headline number."""

    model_config = ConfigDict(frozen=True)

    headline: str
    """The objective's headline test metric (test_accuracy, test_r2, test_perplexity)."""
    headline_value: float
    experiment: str
    parent_run_id: str
    tracking_uri: str
    dataset_hash: str
    preprocess_cached: bool
    stage_seconds: dict[str, float]
    model_uri: str | None
    registered_model: str | None = None
    """Registered model that got a version (None: registration off or model not logged)."""
    model_version: str | None = None
    """The registered version of this run's model."""
    champion: bool = False
    """Whether that version holds the champion alias now."""

    @property
    def test_accuracy(self) -> float:
        """Test accuracy (classification runs; NaN for other objectives)."""
        return self.headline_value if self.headline == "test_accuracy" else float("nan")


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 2)


@flow(name="trainflow-pipeline")
def pipeline(
    preset: str | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    experiment: str | None = None,
) -> PipelineSummary:
    """Run the whole pipeline for a preset (default: demo, or the one the experiment file
    names), an experiment file (a path on the machine the flow runs on) and dotted overrides
    (e.g. train.epochs=3): what a deployment runs. The config is built and checked here."""
    quiet_user_errors()
    cfg = build_config(preset, overrides or [], experiment)
    return run_pipeline(cfg, preflight(cfg))


@flow(name="trainflow-pipeline")
def checked_pipeline(
    cfg: PipelineConfig,
    model: ModelReport,
    preset: str | None = None,
    overrides: list[str] | None = None,
    experiment: str | None = None,
) -> PipelineSummary:
    """Run the whole pipeline for a config the caller built and checked (flows.preflight):
    what `trainflow run` runs, having refused a bad config before Prefect started. `preset`,
    `overrides` and `experiment` are what the command was given: the flow run's parameters
    show them beside the config they resolved to; the run uses `cfg`."""
    quiet_user_errors()
    return run_pipeline(cfg, model)


def run_pipeline(cfg: PipelineConfig, model: ModelReport) -> PipelineSummary:
    """The pipeline body for a validated and checked config (must run inside a flow)."""
    from trainflow.tasks.preprocess.mlflow_dataset import log_dataset_input
    from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
    from trainflow.tasks.train.checkpointing.checkpoint_tags import log_checkpoint
    from trainflow.tasks.train.task import train_task

    get_run_logger().info(model.line())
    runs = PipelineRuns(cfg.tracking, cfg.workdir, cfg.name)
    run_dir = (cfg.workdir / "runs" / runs.parent_id).resolve()
    record = new_record(run_dir, runs.parent_id, runs.tracking_uri, cfg.model_dump_json())
    t: dict[str, float] = {}
    with runs.parent(flatten(cfg)):
        runs.tag(runs.parent_id, {"config_hash": config_hash(cfg)})
        log_experiment(runs, runs.parent_id, cfg)
        get_run_logger().info("run folder %s (trainflow resume continues it)", run_dir)
        code = snapshot_code(runs, user_modules(cfg, model), run_dir / "jobs")
        paths = code.paths if code else []
        code_hash = code.sha256 if code else None
        record = update_record(run_dir, record, code_hash=code_hash, code_paths=paths)
        dataset, cached = preprocess_stage(runs, cfg, t, paths)
        record = update_record(run_dir, record, dataset_hash=dataset.content_hash)
        with runs.stage("train", flatten(cfg.train) | model.params()) as run_id, timed(t, "train"):
            update_record(run_dir, record, train_run_id=run_id)
            log_dataset_input(runs.client, run_id, dataset, "training")
            runs.tag(run_id, lineage_of(runs, cfg, dataset, code_hash=code_hash).tags())
            spec = train_spec(cfg, dataset, run_dir, runs.tracking_uri, run_id, paths)
            ckpt = train_task(spec, cfg.cluster, run_dir / "jobs", cfg.workdir, model)
            log_checkpoint(runs.client, run_id, ckpt)
            runs.tag(run_id, lineage_of(runs, cfg, dataset, ckpt, code_hash).tags())
        result = evaluate_stage(runs, cfg, dataset, ckpt, t, code_hash, paths)
    return summarize(runs, dataset, cached, result, t)


def log_experiment(runs: "PipelineRuns", run_id: str, cfg: PipelineConfig) -> None:
    """The resolved config as the run's artifact experiment.toml: `trainflow run` on it, from
    the run's code/ folder, trains the same run again."""
    header = (
        f"The resolved config of MLflow run {run_id}.\n"
        "Rerun it: trainflow run experiment.toml (from the run's code/ folder, where the\n"
        "user's modules are), with --set for what should differ."
    )
    runs.client.log_text(run_id, experiment.render(cfg, header), "experiment.toml")


def snapshot_code(runs: "PipelineRuns", modules: list[str], job_dir: Path) -> CodeSnapshot | None:
    """Snapshot the user's code into the run's job folder, where ranks, workers and requeued
    attempts import it from; its hash tags the parent run, its files are the artifact code/."""
    code = snapshot_for_jobs(modules, job_dir)
    if code is not None:
        runs.tag(runs.parent_id, {"code_snapshot_hash": code.sha256})
        runs.client.log_artifacts(runs.parent_id, str(code.folder), "code")
        get_run_logger().info("code snapshot %s in %s", code.sha256[:16], code.folder)
    return code


def lineage_of(
    runs: "PipelineRuns",
    cfg: PipelineConfig,
    dataset: DatasetRef,
    ckpt: CheckpointRef | None = None,
    code_hash: str | None = None,
) -> "Lineage":
    """The data, code, config and (once trained) package set behind this run's model."""
    from trainflow.tasks.tracking.lineage import Lineage

    return Lineage(
        dataset_hash=dataset.content_hash,
        git_commit=runs.commit,
        config_hash=config_hash(cfg),
        package_lock_hash=ckpt.package_lock_hash if ckpt else None,
        code_snapshot_hash=code_hash,
    )


def train_spec(
    cfg: PipelineConfig,
    dataset: DatasetRef,
    out_dir: Path,
    tracking_uri: str,
    run_id: str,
    code: list[Path] | None = None,
) -> "TrainJobSpec":
    """The training job's inputs for one config (`code`: the snapshot's folders)."""
    from trainflow.tasks.train.job import TrainJobSpec

    return TrainJobSpec(
        code=code or [],
        train=initial_weights(cfg),
        dataset=dataset,
        out_dir=out_dir,
        cpus_per_task=cfg.cluster.cpus_per_task,
        tracking_uri=tracking_uri,
        run_id=run_id,
        system_metrics_interval_s=cfg.tracking.system_metrics_interval_s,
        signal_delay_s=cfg.cluster.signal_delay_s,
        max_requeues=cfg.cluster.max_requeues,
    )


def preprocess_stage(
    runs: "PipelineRuns", cfg: PipelineConfig, t: dict[str, float], code: list[Path] | None = None
) -> tuple[DatasetRef, bool]:
    """The preprocess child run: dataset (cached on content) and whether the cache served it."""
    from trainflow.tasks.preprocess.mlflow_dataset import log_dataset
    from trainflow.tasks.preprocess.task import preprocess

    get_run_logger().info("MLflow parent run %s in %s", runs.parent_id, runs.tracking_uri)
    cancel_orphaned_jobs(cfg.workdir)
    with runs.stage("preprocess", flatten(cfg.preprocess)) as run_id, timed(t, "preprocess"):
        dataset, cached = preprocess(
            cfg.preprocess, cfg.cluster.dask, cfg.workdir / "datasets", code
        )
        log_dataset(runs.client, run_id, dataset, cached)
    runs.tag(runs.parent_id, {"dataset_hash": dataset.content_hash})
    return dataset, cached


def cancel_orphaned_jobs(workdir: Path) -> None:
    """Cancel the jobs of flow processes that died under `workdir`, each said in a line."""
    for job, cancelled in cancel_orphans(workdir):
        get_run_logger().warning(
            "%s orphaned %s job %s of flow process %d%s",
            "cancelled"
            if cancelled
            else "could not cancel (the scheduler refused; `trainflow cleanup` tries again, "
            "or delete its record under active_jobs/ if the job is gone)",
            job.executor,
            job.job_id,
            job.owner_pid,
            f" (it could not: {job.cancel_requested})" if job.cancel_requested else " (it died)",
        )


def evaluate_stage(
    runs: "PipelineRuns",
    cfg: PipelineConfig,
    dataset: DatasetRef,
    ckpt: CheckpointRef,
    t: dict[str, float],
    code_hash: str | None = None,
    code: list[Path] | None = None,
) -> "EvalResult":
    """The evaluate child run for ``ckpt`` (trained by ``cfg``), then headline numbers on the
    parent run. The run and a registered version carry the lineage (tracking.lineage); `code`
    (the snapshot's folders) is where the model export imports the user's modules from.
    """
    from trainflow.tasks.evaluate.task import evaluate_task
    from trainflow.tasks.preprocess.mlflow_dataset import log_dataset_input

    tags = lineage_of(runs, cfg, dataset, ckpt, code_hash).tags()
    with runs.stage("evaluate", flatten(cfg.evaluate)) as run_id, timed(t, "evaluate"):
        log_dataset_input(runs.client, run_id, dataset, "evaluation")
        runs.tag(run_id, tags)
        result = evaluate_task(
            cfg.evaluate, cfg.train, dataset, ckpt, runs.tracking_uri, run_id, tags, code
        )
    seconds = {f"seconds_{k}": v for k, v in t.items()}
    runs.log_summary(runs.parent_id, {result.headline: result.headline_value, **seconds})
    words = result.headline.replace("_", " ")
    get_run_logger().info("%s %.4f (stage seconds: %s)", words, result.headline_value, t)
    return result


def summarize(
    runs: "PipelineRuns",
    dataset: DatasetRef,
    cached: bool,
    result: "EvalResult",
    t: dict[str, float],
) -> PipelineSummary:
    """The small result the flow returns; also published as a Markdown artifact."""
    link = run_link(runs.tracking_uri, runs.experiment_id, runs.parent_id)
    stages = runs_and_plots_markdown(runs.tracking_uri, runs.experiment_id, runs.stage_ids)
    create_markdown_artifact(
        summary_markdown(runs.experiment, link, dataset, result, t) + stages,
        key="trainflow-summary",
        description="headline test metric, dataset hash, model version and MLflow run",
    )
    reg = result.registry
    return PipelineSummary(
        headline=result.headline,
        headline_value=result.headline_value,
        experiment=runs.experiment,
        parent_run_id=runs.parent_id,
        tracking_uri=runs.tracking_uri,
        dataset_hash=dataset.content_hash,
        preprocess_cached=cached,
        stage_seconds=t,
        model_uri=result.model_uri,
        registered_model=reg.name if reg else None,
        model_version=reg.version if reg else None,
        champion=reg.champion if reg else False,
    )
