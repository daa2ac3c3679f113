"""`trainflow resume`: continue a pipeline run that failed, was cancelled or lost its flow
process (or extend a finished one) from its last checkpoint, in the same MLflow runs.

The run's folder holds its record (flows.run_record: the resolved config, the MLflow runs, the
dataset's hash, the code snapshot), its checkpoints and its job files. A resume reads the
record, takes the same config (only what cannot change the run's past may be set: a longer
`train.epochs` and similar, `cluster.*`), checks the user's code from the run's snapshot, finds
the same dataset (its content hash checked), and submits the training job on the same folder:
the job resumes from the newest checkpoint there by itself, as a requeued job does. The parent
and train runs are RUNNING again; evaluation runs anew as a new evaluate run. The training
journal is sent again from its start, so points kept through a tracking outage arrive, and
MLflow's SQL store keeps a point it already has once.
"""

import copy
from pathlib import Path

from prefect import flow, get_run_logger

from trainflow.errors import ConfigError
from trainflow.flows.config import PipelineConfig, flatten, parse_override, set_path, validated
from trainflow.flows.error_output import quiet_user_errors
from trainflow.flows.pipeline import (
    PipelineSummary,
    cancel_orphaned_jobs,
    evaluate_stage,
    lineage_of,
    summarize,
    timed,
    train_spec,
)
from trainflow.flows.run_record import RunRecord, find_run, read_record, still_running
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.progress import MAY_CHANGE_ON_RESUME

MAY_CHANGE = (
    *sorted(f"train.{key}" for key in MAY_CHANGE_ON_RESUME - {"parallel"}),
    "train.parallel.*",
    "cluster.*",
)
"""What `--set` may change on a resume: nothing the run's checkpoints depend on."""


def build_resume(
    target: str, workdir: Path, overrides: list[str]
) -> tuple[PipelineConfig, RunRecord, Path]:
    """The config, record and folder of the run `target` names (its folder, or its parent
    run id under `workdir`), with `overrides` applied: ConfigError in one line for a run
    still running, a key that may not change, or a shorter run."""
    run_dir = find_run(target, workdir)
    record = read_record(run_dir)
    if still_running(record):
        raise ConfigError(
            f"run {record.parent_run_id} is still running (flow process {record.pid} on this "
            f"host): stop it first (Ctrl-C, or kill {record.pid}), then resume it"
        )
    tree = copy.deepcopy(record.config)
    for text in overrides:
        path, value = parse_override(text)
        key = ".".join(path)
        if not (key.startswith(("cluster.", "train.parallel.")) or key in MAY_CHANGE):
            raise ConfigError(
                f"--set {key}: a resumed run keeps its config; only {', '.join(MAY_CHANGE)} may "
                "change (start a new run with `trainflow run` to change anything else)"
            )
        set_path(tree, path, value)
    # The run's folder is where it is now: a relative workdir meant the first run's cwd.
    tree["workdir"] = str(run_dir.parent.parent)
    cfg = validated(tree)
    for key in ("epochs", "max_steps"):
        before, now = record.config["train"].get(key), getattr(cfg.train, key)
        if before is not None and (now is None or now < int(before)):
            raise ConfigError(
                f"--set train.{key}={now} is below the run's {before}: a resume continues "
                "or extends a run, it does not shorten it"
            )
    return cfg, record, run_dir


@flow(name="trainflow-resume")
def resumed_pipeline(
    cfg: PipelineConfig, model: ModelReport, record: RunRecord, run_dir: Path
) -> PipelineSummary:
    """Continue the pipeline run of `record` in `run_dir` with `cfg` (build_resume's, its
    user code checked from the run's snapshot)."""
    quiet_user_errors()
    return run_resume(cfg, model, record, run_dir)


def run_resume(
    cfg: PipelineConfig, model: ModelReport, record: RunRecord, run_dir: Path
) -> PipelineSummary:
    """The resume's body (must run inside a flow)."""
    from trainflow.flows.run_record import update_record
    from trainflow.tasks.preprocess.task import preprocess
    from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
    from trainflow.tasks.train.checkpointing.checkpoint_tags import log_checkpoint
    from trainflow.tasks.train.task import train_task

    logger = get_run_logger()
    runs = PipelineRuns(cfg.tracking, cfg.workdir, cfg.name, parent_id=record.parent_run_id)
    record = _taken_over(run_dir, record)
    paths, t = record.code_paths, dict[str, float]()
    with runs.resume_parent():
        logger.info("resuming pipeline run %s from %s", record.parent_run_id, run_dir)
        changed = _changes(record, cfg)
        if changed:
            runs.tag(runs.parent_id, {"resumed_with": changed})
        cancel_orphaned_jobs(cfg.workdir)
        dataset, cached = preprocess(
            cfg.preprocess, cfg.cluster.dask, cfg.workdir / "datasets", paths
        )
        if record.dataset_hash and dataset.content_hash != record.dataset_hash:
            raise ConfigError(
                f"the data changed since run {record.parent_run_id}: its dataset hash is now "
                f"{dataset.content_hash[:16]}, the run trained on {record.dataset_hash[:16]}; "
                "restore the data it trained on, or start a new run"
            )
        params = flatten(cfg.train) | model.params()
        with runs.resume_stage("train", record.train_run_id, params) as run_id, timed(t, "train"):
            record = update_record(
                run_dir, record, dataset_hash=dataset.content_hash, train_run_id=run_id
            )
            spec = train_spec(cfg, dataset, run_dir, runs.tracking_uri, run_id, paths)
            ckpt = train_task(spec, cfg.cluster, run_dir / "jobs", cfg.workdir, model)
            log_checkpoint(runs.client, run_id, ckpt)
            runs.tag(run_id, lineage_of(runs, cfg, dataset, ckpt, record.code_hash).tags())
        result = evaluate_stage(runs, cfg, dataset, ckpt, t, record.code_hash, paths)
    return summarize(runs, dataset, cached, result, t)


def _taken_over(run_dir: Path, record: RunRecord) -> RunRecord:
    """The record, now naming this process as the one running the run."""
    import os
    import socket
    import time

    from trainflow.flows.run_record import update_record

    here = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    return update_record(run_dir, record, **here)


def _changes(record: RunRecord, cfg: PipelineConfig) -> str:
    """The keys this resume set to other values than the run had, as `key=value` words."""
    before = flatten(validated({**record.config, "workdir": str(cfg.workdir)}))
    now = flatten(cfg)
    return " ".join(f"{k}={v}" for k, v in sorted(now.items()) if before.get(k) != v)
