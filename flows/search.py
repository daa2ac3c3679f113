"""The search flow: one dataset, an Optuna study whose trials array tasks pull and train
(pruned when losing), the best trial evaluated and registered. MLflow: a parent run, a
preprocess run, one child run per trial (tasks.search.trial_runs), an evaluate run.
"""

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from trainflow.errors import ConfigError, JobError
from trainflow.flows.config import (
    PipelineConfig,
    _as_mapping,
    build_config,
    config_hash,
    flatten,
)
from trainflow.flows.error_output import quiet_user_errors
from trainflow.flows.pipeline import (
    PipelineSummary,
    evaluate_stage,
    log_experiment,
    preprocess_stage,
    snapshot_code,
    summarize,
    timed,
)
from trainflow.flows.preflight import check_code, check_inputs, user_modules
from trainflow.tasks.objectives import make_objective
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.study import StudyRef, make_ref, open_study, probe_storage
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.monitor import monitor_for
from trainflow.tasks.train.ref import CheckpointRef


class SearchSummary(PipelineSummary):
    """A pipeline summary plus the study's outcome."""

    study: str
    """The Optuna study's name (continued by a search with the same name and storage)."""
    best_trial: int
    """Number of the best complete trial (evaluated and registered)."""
    best_params: dict[str, Any]
    """Its values of the space."""
    trials: list[str]
    """One line per trial of the study, in order (tasks.search.watch.trial_line)."""


def build_search(
    preset: str | None,
    overrides: list[str] | dict[str, Any],
    search: SearchConfig,
    experiment: Path | str | None = None,
) -> tuple[PipelineConfig, StudyRef, ModelReport]:
    """The base config, the study and the model report, every mistake refused (ConfigError,
    one line) before any job: the space's keys and values (each bound and choice built into a
    whole config), the pruner's metric, the storage (opened and written)."""
    base_items = dict(overrides) if isinstance(overrides, dict) else _as_mapping(overrides)
    base = build_config(preset, base_items, experiment)
    spec = check_inputs(base)
    objective = make_objective(base.train.objective, spec, base.train.objective_args)
    monitor = monitor_for(base.train, objective)  # the pruner watches what picks the best
    metric = monitor.metric
    if base.preprocess.val_fraction == 0:
        needs = f"--pruner {search.pruner}" if search.pruner != "none" else "the search"
        raise ConfigError(
            f"{needs} needs the validation metric {metric} after every epoch, but "
            "preprocess.val_fraction=0 leaves no validation split: --set "
            "preprocess.val_fraction=0.1"
        )
    ref = make_ref(
        search,
        base.workdir,
        base.cluster.executor,
        base.name,
        metric,
        monitor.higher,
    )
    trains = []
    for param in ref.space:
        for value in param.samples():
            try:
                cfg = build_config(preset, {**base_items, param.key: value}, experiment)
            except ConfigError as err:
                raise ConfigError(
                    f"search space {param.key}={param.text()}: the value {value!r} "
                    f"does not fit: {str(err).removeprefix('invalid config:').strip()}"
                ) from None
            trains.append(cfg.train)
    probe_storage(ref)
    return base, ref, check_code(base, spec, trains)


@flow(name="trainflow-search")
def search(
    preset: str | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    space: dict[str, Any] | None = None,
    trials: int = 16,
    parallel: int = 2,
    sampler: str = "tpe",
    pruner: str = "asha",
    storage: str | None = None,
    study: str | None = None,
    experiment: str | None = None,
    seed: int | None = None,
) -> SearchSummary:
    """Search `space` (e.g. {"train.lr": "loguniform(1e-4,1e-1)"}) over the base config
    (preset, experiment file, overrides: as the pipeline's) with Optuna, `parallel` array
    tasks pulling `trials` trials (`seed`: the sampler's); evaluate the best."""
    quiet_user_errors()
    cfg = SearchConfig.model_validate(
        {
            "space": space or {},
            "trials": trials,
            "parallel": parallel,
            "sampler": sampler,
            "pruner": pruner,
            "storage": storage,
            "study": study,
            "seed": seed,
        }
    )
    base, ref, model = build_search(preset, overrides or [], cfg, experiment)
    return run_search(base, ref, cfg.parallel, model)


@flow(name="trainflow-search")
def checked_search(
    base: PipelineConfig,
    ref: StudyRef,
    parallel: int,
    model: ModelReport,
    preset: str | None = None,
    overrides: list[str] | None = None,
    space: list[str] | None = None,
    experiment: str | None = None,
) -> SearchSummary:
    """The search the caller built and checked (`trainflow sweep --space`); `preset`,
    `overrides`, `space` and `experiment`, what the command was given, are shown with the
    flow run."""
    quiet_user_errors()
    return run_search(base, ref, parallel, model)


def run_search(
    base: PipelineConfig, ref: StudyRef, parallel: int, model: ModelReport
) -> SearchSummary:
    """The search body for a validated and checked config (must run inside a flow)."""
    from trainflow.flows.pipeline import train_spec
    from trainflow.tasks.search.plots import log_study_plots
    from trainflow.tasks.search.task import search_task
    from trainflow.tasks.search.trial_worker import CHECKPOINT_ATTR, SearchJob, trial_train
    from trainflow.tasks.search.watch import trial_lines
    from trainflow.tasks.tracking.pipeline_runs import PipelineRuns

    runs = PipelineRuns(base.tracking, base.workdir, f"{base.name}-search")
    space = {p.key: p.text() for p in ref.space}
    t: dict[str, float] = {}
    params = {
        "search.space": json.dumps(space),
        "search.study": ref.name,
        "search.trials": str(ref.trials),
        "search.parallel": str(parallel),
        "search.sampler": ref.sampler,
        "search.pruner": ref.pruner,
    }
    with runs.parent({**flatten(base), **params}):
        log_experiment(runs, runs.parent_id, base)
        run_dir = (base.workdir / "runs" / runs.parent_id).resolve()
        code = snapshot_code(runs, user_modules(base, model), run_dir / "jobs")
        paths = code.paths if code else []
        dataset, cached = preprocess_stage(runs, base, t, paths)
        # Trials' folders are the study's, not this run's: a rerun resumes a retried trial.
        trials_dir = (base.workdir / "studies" / ref.name).resolve()
        spec = train_spec(base, dataset, trials_dir, runs.tracking_uri, "", paths)
        job = SearchJob(
            study=ref, base=spec.model_copy(update={"run_id": None}), parent_run_id=runs.parent_id
        )
        with timed(t, "train"):
            outcomes = search_task(job, parallel, base.cluster, run_dir / "jobs", base.workdir)
        study = open_study(ref)
        log_study_plots(
            runs.client, runs.parent_id, study, run_dir / "plots", get_run_logger().warning
        )
        complete = [
            t_
            for t_ in study.get_trials()
            if CHECKPOINT_ATTR in t_.user_attrs and t_.state.name == "COMPLETE"
        ]
        if not complete:
            raise JobError("no trial of the search completed:\n" + "\n".join(map(str, outcomes)))
        sign = 1.0 if ref.direction == "maximize" else -1.0
        best = max(complete, key=lambda t_: (sign * t_.value, -t_.number))
        best_cfg = base.model_copy(update={"train": trial_train(base.train, best.params)})
        ckpt = CheckpointRef.model_validate(best.user_attrs[CHECKPOINT_ATTR])
        runs.tag(
            runs.parent_id,
            {
                "best_trial": str(best.number),
                "best_params": json.dumps(best.params),
                "config_hash": config_hash(best_cfg),
            },
        )
        get_run_logger().info("best trial %d: %s", best.number, best.params)
        result = evaluate_stage(
            runs, best_cfg, dataset, ckpt, t, code.sha256 if code else None, paths
        )
    lines = trial_lines(study, ref.metric)
    summary = summarize(runs, dataset, cached, result, t)
    return SearchSummary(
        **summary.model_dump(),
        study=ref.name,
        best_trial=best.number,
        best_params=best.params,
        trials=lines,
    )
