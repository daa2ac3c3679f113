"""The bodies of the `trainflow` commands that run flows or act on jobs (run, resume, sweep,
search, cleanup): what each prints, how an interrupt or a refused credential ends it.
The parser and the dispatch are flows.cli."""

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from trainflow.errors import ConfigError
from trainflow.flows.config import PipelineConfig, build_config
from trainflow.flows.ui_command import ui_args


def print_summary(summary: object, cfg: PipelineConfig) -> None:
    from trainflow.flows.pipeline import PipelineSummary

    assert isinstance(summary, PipelineSummary)
    if summary.tracking_uri.startswith(("http://", "https://")):
        ui_line = f"{summary.tracking_uri}   (the tracking server's own UI)"
    else:
        ui = " ".join(ui_args(cfg, 5000))
        ui_line = f"trainflow ui   (or: mlflow {ui}) -> http://127.0.0.1:5000"
    version = "not registered"
    if summary.model_version is not None:
        state = "now the champion" if summary.champion else "not the champion"
        version = f"{summary.registered_model} v{summary.model_version} ({state})"
    print(
        "\n== trainflow summary ==\n"
        f"{summary.headline.replace('_', ' '):<15} {summary.headline_value:.4f}\n"
        f"experiment      {summary.experiment}\n"
        f"parent run id   {summary.parent_run_id}\n"
        f"tracking URI    {summary.tracking_uri}\n"
        f"dataset hash    {summary.dataset_hash[:16]} "
        f"({'cached' if summary.preprocess_cached else 'built'})\n"
        f"stage seconds   {summary.stage_seconds}\n"
        f"model version   {version}\n"
        f"run folder      {(cfg.workdir / 'runs' / summary.parent_run_id).resolve()}\n"
        f"MLflow UI       {ui_line}"
    )


def cleanup(cfg: PipelineConfig) -> int:
    from trainflow.cluster.registry import cancel_orphans, record_path

    orphans = cancel_orphans(cfg.workdir)
    for job, cancelled in orphans:
        whose = f"its flow process {job.owner_pid}" + (
            f" could not cancel it: {job.cancel_requested}" if job.cancel_requested else " died"
        )
        if cancelled:
            print(f"cancelled {job.executor} job {job.job_id} ({whose})")
        else:
            print(
                f"trainflow: error: the scheduler refused the cancel of {job.executor} job "
                f"{job.job_id} ({whose}): run `trainflow cleanup` again once slurmctld answers "
                f"(scontrol ping), or delete {record_path(cfg.workdir, job.job_id)} if the "
                "job is gone (squeue)",
                file=sys.stderr,
            )
    if not orphans:
        print(f"no orphaned jobs under {cfg.workdir}")
    return 1 if any(not cancelled for _, cancelled in orphans) else 0


def search(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from trainflow.flows.search import build_search
    from trainflow.tasks.search.config import SearchConfig
    from trainflow.tasks.search.space import parse_space

    if args.grid:
        raise ConfigError("pass --grid or --space, not both (a grid is --sampler grid)")
    try:
        cfg = SearchConfig(
            space={p.key: p.text() for p in parse_space(args.space)},
            trials=args.trials,
            parallel=args.parallel,
            sampler=args.sampler,
            pruner=args.pruner,
            storage=args.storage,
            study=args.study,
            seed=args.seed,
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"--{first['loc'][0]}: {first['msg']}") from None
    base, ref, model = build_search(args.preset, args.overrides, cfg, args.experiment)
    print(model.line(), flush=True)
    print(f"study {ref.name} in {ref.storage.split('@')[-1]}: {ref.trials} trials", flush=True)
    prepare_flow_process()
    from trainflow.flows.search import checked_search

    try:
        summary = checked_search(
            base,
            ref,
            cfg.parallel,
            model,
            args.preset,
            args.overrides,
            args.space,
            args.experiment,
        )
    except KeyboardInterrupt:
        print("trainflow: interrupted; the search tasks were cancelled", file=sys.stderr)
        return 130
    except Exception as err:
        return refused(err)
    print(f"\n== trials of study {summary.study} ==")
    for line in summary.trials:
        print(line)
    print(f"best: trial {summary.best_trial} {summary.best_params}")
    print_summary(summary, base)
    return 0


def sweep(args: argparse.Namespace) -> int:
    from trainflow.flows.config import build_sweep, parse_override

    if args.space:
        return search(args)
    from trainflow.flows.preflight import preflight

    grid = {".".join(path): value for path, value in map(parse_override, args.grid)}
    base, elements = build_sweep(args.preset, args.overrides, grid, args.experiment)
    model = preflight(base, [cfg.train for _, cfg in elements])  # before Prefect starts
    print(model.line(), flush=True)
    prepare_flow_process()
    from trainflow.flows.sweep import checked_sweep

    try:
        summary = checked_sweep(
            base, elements, model, args.preset, args.overrides, grid, args.experiment
        )
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training jobs were cancelled", file=sys.stderr)
        return 130
    except Exception as err:
        return refused(err)
    for i, acc in enumerate(summary.val_accuracy):
        print(f"element {i}: val_accuracy {acc}")
    print(f"best: {summary.best_overrides}")
    print_summary(summary, base)
    return 0


def refused(err: Exception) -> int:
    """Exit 2 with what to fix when a server refused our credentials; re-raise anything else."""
    from trainflow.flows.service_errors import explain_refusal

    message = explain_refusal(err)
    if message is None:
        raise err
    print(f"trainflow: error: {message}", file=sys.stderr)
    return 2


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def prepare_flow_process() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # SIGTERM (kill, a batch system ending us) must cancel the training job like Ctrl-C does;
    # SIGINT is restored too, as a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def run(args: argparse.Namespace) -> int:
    """`trainflow run`: the config checked before Prefect starts, then the pipeline flow."""
    from trainflow.flows.preflight import preflight

    cfg = config_of(args)
    # Bad data, a bad Slurm request or a mistake in the user's code: one line, before Prefect
    # (and its server) or any job starts. The flow gets the config and the check's report.
    model = preflight(cfg)
    print(model.line(), flush=True)
    prepare_flow_process()
    from trainflow.flows.pipeline import checked_pipeline

    return _summarised(
        lambda: checked_pipeline(cfg, model, args.preset, args.overrides, args.experiment), cfg
    )


def resume(args: argparse.Namespace) -> int:
    """`trainflow resume`: the run's record read and checked, then the resume flow."""
    from trainflow.cluster.snapshot import code_path
    from trainflow.flows.preflight import preflight
    from trainflow.flows.resume import build_resume

    cfg, record, run_dir = build_resume(args.run, Path(args.workdir), args.overrides)
    with code_path(record.code_paths):  # the user's code as the run snapshotted it
        model = preflight(cfg)
    print(model.line(), flush=True)
    print(f"resuming run {record.parent_run_id} from {run_dir}", flush=True)
    prepare_flow_process()
    from trainflow.flows.resume import resumed_pipeline

    return _summarised(lambda: resumed_pipeline(cfg, model, record, run_dir), cfg)


def _summarised(flow: Callable[[], object], cfg: PipelineConfig) -> int:
    """Run a pipeline `flow` and print its summary: 0; 130 when interrupted (the job cancelled),
    2 for a server that refused our credentials."""
    try:
        summary = flow()
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training job was cancelled", file=sys.stderr)
        return 130
    except Exception as err:
        return refused(err)
    print_summary(summary, cfg)
    return 0


def config_of(args: argparse.Namespace) -> PipelineConfig:
    """The config the command's preset, experiment file and --set build (validated)."""
    return build_config(args.preset, args.overrides, args.experiment)
