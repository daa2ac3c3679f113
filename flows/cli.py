"""The ``trainflow`` command line: run a pipeline, inspect presets and config, open the UI."""

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from trainflow.errors import DEBUG_ENV, ConfigError, JobError, TrainflowError, debug_enabled
from trainflow.flows.config import PRESETS, PipelineConfig, build_config
from trainflow.flows.ui_command import serve_ui, ui_args
from trainflow.tasks.open_files import open_files_advice, too_many_open_files

_DEBUG_HELP = "show tracebacks of errors (also: TRAINFLOW_DEBUG=1)"


def parser() -> argparse.ArgumentParser:
    """The `trainflow` command's argument parser (docs/cli.md renders it)."""
    top = argparse.ArgumentParser(prog="trainflow", description=__doc__)
    top.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    # `--debug` after the command too; SUPPRESS keeps a top-level --debug from being reset.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    sub = top.add_subparsers(dest="command", required=True)
    config_args = argparse.ArgumentParser(add_help=False)  # how every command builds a config
    config_args.add_argument(
        "experiment",
        nargs="?",
        help="an experiment file (TOML: the config keys in sections, see docs/experiments.md)",
    )
    config_args.add_argument(
        "--preset",
        help=f"start from a preset: {', '.join(PRESETS)} (default: the file's, else demo)",
    )
    _set_option(
        config_args,
        "dotted override over the preset and the file, e.g. --set train.epochs=3 (repeatable)",
    )
    sub.add_parser(
        "run",
        help="run a whole pipeline: preprocess -> train -> evaluate",
        parents=[common, config_args],
    )
    cfg_cmd = sub.add_parser(
        "config", help="print the resolved, validated config", parents=[common, config_args]
    )
    cfg_cmd.add_argument(
        "--format",
        choices=["json", "toml"],
        default="json",
        help="toml: as an experiment file, a starting point for your own",
    )
    sw = sub.add_parser(
        "sweep",
        help="train a grid (--grid) or search a space (--space) as one job array, evaluate "
        "the best",
        parents=[common, config_args],
    )
    sw.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=[V1,V2,...]",
        help="a train.* key and its values as a JSON list (repeatable: the grid is the product)",
    )
    _search_args(sw)
    res = sub.add_parser(
        "resume",
        help="continue a pipeline run that failed, was cancelled or lost its process (or "
        "extend a finished one) from its last checkpoint, in the same MLflow runs",
        parents=[common],
    )
    res.add_argument("run", help="the run's folder (<workdir>/runs/<id>) or its parent run id")
    res.add_argument(
        "--workdir",
        default=str(PipelineConfig().workdir),
        help=f"where to find a run given by id (default: {PipelineConfig().workdir})",
    )
    _set_option(
        res,
        "what may change: a longer train.epochs, the hang and straggler allowances, cluster.* "
        "(repeatable)",
    )
    sub.add_parser("presets", help="list the named presets")
    clu = sub.add_parser("cluster", help="a dev Slurm cluster of N nodes on this machine")
    clu.add_argument("action", choices=["up", "down", "status"])
    clu.add_argument("--nodes", type=int, help="up: nodes to emulate (default: as before, else 2)")
    clu.add_argument("--fresh", action="store_true", help="up: wipe the cluster's state first")
    sub.add_parser(
        "cleanup",
        help="cancel jobs whose watching flow process died (under the config's workdir)",
        parents=[config_args],
    )
    ui = sub.add_parser(
        "ui",
        help="start the MLflow UI on the store the pipeline's runs used (the config's)",
        parents=[config_args],
    )
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    ui.add_argument("--port", type=int, default=5000, help="port to listen on")
    return top


def _set_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """The repeatable --set KEY=VALUE option (into args.overrides)."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def _search_args(sw: argparse.ArgumentParser) -> None:
    """The search mode of `trainflow sweep` (docs/search.md)."""
    sw.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="KEY=KIND(ARGS)",
        help="search instead of a grid: a train.* key and its values, e.g. "
        "train.lr=loguniform(1e-4,1e-1), train.width=int(16,128), "
        "train.batch_size=choice(32,64,128) (repeatable)",
    )
    sw.add_argument("--trials", type=int, default=16, help="search: trials in the budget")
    sw.add_argument("--parallel", type=int, default=2, help="search: trials trained at once")
    sw.add_argument(
        "--sampler",
        choices=["tpe", "grid", "random"],
        default="tpe",
        help="search: how trials are drawn (grid: every point of choice() spaces)",
    )
    sw.add_argument(
        "--pruner",
        choices=["asha", "median", "none"],
        default="asha",
        help="search: how losing trials are stopped early (none: every trial trains to its end)",
    )
    sw.add_argument(
        "--storage",
        help="search: the study's database URL (default: SQLite under the workdir; Slurm: "
        "e.g. postgresql+psycopg://user:password@host/db)",
    )
    sw.add_argument("--study", help="search: study name (the same name continues the study)")
    sw.add_argument(
        "--seed",
        type=int,
        help="search: seeds each array task's sampler (docs/search.md: what it makes reproducible)",
    )


def _print_summary(summary: object, cfg: PipelineConfig) -> None:
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


def _cleanup(cfg: PipelineConfig) -> int:
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


def _search(args: argparse.Namespace) -> int:
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
    _prepare_flow_process()
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
        return _refused(err)
    print(f"\n== trials of study {summary.study} ==")
    for line in summary.trials:
        print(line)
    print(f"best: trial {summary.best_trial} {summary.best_params}")
    _print_summary(summary, base)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from trainflow.flows.config import build_sweep, parse_override

    if args.space:
        return _search(args)
    from trainflow.flows.preflight import preflight

    grid = {".".join(path): value for path, value in map(parse_override, args.grid)}
    base, elements = build_sweep(args.preset, args.overrides, grid, args.experiment)
    model = preflight(base, [cfg.train for _, cfg in elements])  # before Prefect starts
    print(model.line(), flush=True)
    _prepare_flow_process()
    from trainflow.flows.sweep import checked_sweep

    try:
        summary = checked_sweep(
            base, elements, model, args.preset, args.overrides, grid, args.experiment
        )
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training jobs were cancelled", file=sys.stderr)
        return 130
    except Exception as err:
        return _refused(err)
    for i, acc in enumerate(summary.val_accuracy):
        print(f"element {i}: val_accuracy {acc}")
    print(f"best: {summary.best_overrides}")
    _print_summary(summary, base)
    return 0


def _refused(err: Exception) -> int:
    """Exit 2 with what to fix when a server refused our credentials; re-raise anything else."""
    from trainflow.flows.service_errors import explain_refusal

    message = explain_refusal(err)
    if message is None:
        raise err
    print(f"trainflow: error: {message}", file=sys.stderr)
    return 2


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _prepare_flow_process() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # SIGTERM (kill, a batch system ending us) must cancel the training job like Ctrl-C does;
    # SIGINT is restored too, as a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def _run(args: argparse.Namespace) -> int:
    from trainflow.flows.preflight import preflight

    cfg = _config(args)
    # Bad data, a bad Slurm request or a mistake in the user's code: one line, before Prefect
    # (and its server) or any job starts. The flow gets the config and the check's report.
    model = preflight(cfg)
    print(model.line(), flush=True)
    _prepare_flow_process()
    from trainflow.flows.pipeline import checked_pipeline

    try:
        summary = checked_pipeline(cfg, model, args.preset, args.overrides, args.experiment)
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training job was cancelled", file=sys.stderr)
        return 130
    except Exception as err:
        return _refused(err)
    _print_summary(summary, cfg)
    return 0


def _resume(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainflow.cluster.snapshot import code_path
    from trainflow.flows.preflight import preflight
    from trainflow.flows.resume import build_resume

    cfg, record, run_dir = build_resume(args.run, Path(args.workdir), args.overrides)
    with code_path(record.code_paths):  # the user's code as the run snapshotted it
        model = preflight(cfg)
    print(model.line(), flush=True)
    print(f"resuming run {record.parent_run_id} from {run_dir}", flush=True)
    _prepare_flow_process()
    from trainflow.flows.resume import resumed_pipeline

    try:
        summary = resumed_pipeline(cfg, model, record, run_dir)
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training job was cancelled", file=sys.stderr)
        return 130
    except Exception as err:
        return _refused(err)
    _print_summary(summary, cfg)
    return 0


def _config(args: argparse.Namespace) -> PipelineConfig:
    """The config the command's preset, experiment file and --set build (validated)."""
    return build_config(args.preset, args.overrides, args.experiment)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainflow`` command."""
    args = parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the flows and the training job's payload see it too
    try:
        if args.command == "presets":
            for name in PRESETS:
                print(name)
            return 0
        if args.command == "config":
            cfg = _config(args)
            if args.format == "toml":
                from trainflow.flows.experiment import render

                print(render(cfg), end="")
            else:
                print(cfg.model_dump_json(indent=2))
            return 0
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "cluster":
            from trainflow.cluster.dev.slurm import run as slurm

            return slurm(args.action, nodes=args.nodes, fresh=args.fresh)
        if args.command == "resume":
            return _resume(args)
        if args.command == "cleanup":
            return _cleanup(_config(args))
        if args.command == "ui":
            return serve_ui(_config(args), args.host, args.port)
        return _run(args)
    except TrainflowError as err:
        if debug_enabled():
            traceback.print_exc()
            if isinstance(err, JobError) and err.detail:  # a failed job's remote tracebacks
                print(err.detail, file=sys.stderr)
        advice = ""  # a rank's EMFILE reaches here as what it raised: add the limit's advice
        if too_many_open_files(err) and "ulimit" not in str(err):
            advice = f"; {open_files_advice()}"
        print(f"trainflow: error: {err}{advice}", file=sys.stderr)
        return 2
    except OSError as err:  # EMFILE in this process, wherever it came from: one line
        if not too_many_open_files(err) or debug_enabled():
            raise
        print(f"trainflow: error: {open_files_advice()} ({err})", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The ``trainflow`` command."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
