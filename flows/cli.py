"""The ``trainflow`` command line: run a pipeline, inspect presets and config, open the UI."""

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from flows.config import PRESETS, PipelineConfig, build_config
from tasks.errors import TrainflowError
from tasks.tracking.runs import resolve_tracking_uri


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "run a whole pipeline: preprocess -> train -> evaluate"),
        ("config", "print the resolved, validated config as JSON"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--preset", default="demo", help=f"one of: {', '.join(PRESETS)}")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="dotted override, e.g. --set train.epochs=3 (repeatable)",
        )
    sw = sub.add_parser("sweep", help="train a grid of configs as one job array, evaluate the best")
    sw.add_argument("--preset", default="demo", help=f"one of: {', '.join(PRESETS)}")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    sw.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=[V1,V2,...]",
        help="a train.* key and its values as a JSON list (repeatable: the grid is the product)",
    )
    sub.add_parser("presets", help="list the named presets")
    clu = sub.add_parser("cluster", help="a single-node Slurm on this machine (dev and CI)")
    clu.add_argument("action", choices=["up", "down", "status"])
    clean = sub.add_parser("cleanup", help="cancel jobs whose watching flow process died")
    clean.add_argument("--preset", default="demo")
    clean.add_argument("--set", dest="overrides", action="append", default=[])
    ui = sub.add_parser("ui", help="start the MLflow UI on the pipeline's store")
    ui.add_argument("--preset", default="demo")
    ui.add_argument("--set", dest="overrides", action="append", default=[])
    ui.add_argument("--port", type=int, default=5000)
    return parser


def _ui_command(cfg: PipelineConfig, port: int) -> list[str]:
    uri = resolve_tracking_uri(cfg.tracking, cfg.workdir)
    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--port", str(port)]


def _print_summary(summary: object, cfg: PipelineConfig) -> None:
    from flows.pipeline import PipelineSummary

    assert isinstance(summary, PipelineSummary)
    ui = " ".join(_ui_command(cfg, 5000)[3:])
    version = "not registered"
    if summary.model_version is not None:
        state = "now the champion" if summary.champion else "not the champion"
        version = f"{summary.registered_model} v{summary.model_version} ({state})"
    print(
        "\n== trainflow summary ==\n"
        f"test accuracy   {summary.test_accuracy:.4f}\n"
        f"experiment      {summary.experiment}\n"
        f"parent run id   {summary.parent_run_id}\n"
        f"tracking URI    {summary.tracking_uri}\n"
        f"dataset hash    {summary.dataset_hash[:16]} "
        f"({'cached' if summary.preprocess_cached else 'built'})\n"
        f"stage seconds   {summary.stage_seconds}\n"
        f"model version   {version}\n"
        f"MLflow UI       trainflow ui   (or: mlflow {ui}) -> http://127.0.0.1:5000"
    )


def _cleanup(cfg: PipelineConfig) -> int:
    from cluster.registry import cancel_orphans

    orphans = cancel_orphans(cfg.workdir)
    for job in orphans:
        print(f"cancelled {job.executor} job {job.job_id} (its flow process {job.owner_pid} died)")
    if not orphans:
        print(f"no orphaned jobs under {cfg.workdir}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from flows.config import build_sweep, parse_override

    grid = {".".join(path): value for path, value in map(parse_override, args.grid)}
    base, _ = build_sweep(args.preset, args.overrides, grid)  # fail fast, before Prefect
    _prepare_flow_process()
    from flows.sweep import sweep

    try:
        summary = sweep(preset=args.preset, overrides=args.overrides, grid=grid)
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training jobs were cancelled", file=sys.stderr)
        return 130
    for i, acc in enumerate(summary.val_accuracy):
        print(f"element {i}: val_accuracy {acc}")
    print(f"best: {summary.best_overrides}")
    _print_summary(summary, base)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _prepare_flow_process() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # SIGTERM (kill, a batch system ending us) must cancel the training job like Ctrl-C does;
    # SIGINT is restored too, as a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def _run(args: argparse.Namespace) -> int:
    cfg = build_config(args.preset, args.overrides)  # fail fast, before Prefect starts
    _prepare_flow_process()
    from flows.pipeline import pipeline

    try:
        summary = pipeline(preset=args.preset, overrides=args.overrides)
    except KeyboardInterrupt:
        print("trainflow: interrupted; the training job was cancelled", file=sys.stderr)
        return 130
    _print_summary(summary, cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainflow`` command."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "presets":
            for name in PRESETS:
                print(name)
            return 0
        if args.command == "config":
            print(build_config(args.preset, args.overrides).model_dump_json(indent=2))
            return 0
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "cluster":
            from cluster.dev.slurm import run as slurm

            return slurm(args.action)
        if args.command == "cleanup":
            return _cleanup(build_config(args.preset, args.overrides))
        if args.command == "ui":
            cfg = build_config(args.preset, args.overrides)
            # Without this the server forks a job runner and 7 workers (~1.5 GB) for one user.
            os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            return subprocess.call(_ui_command(cfg, args.port))
        return _run(args)
    except TrainflowError as err:
        print(f"trainflow: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
