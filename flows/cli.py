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
    sub.add_parser("presets", help="list the named presets")
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
    print(
        "\n== trainflow summary ==\n"
        f"test accuracy   {summary.test_accuracy:.4f}\n"
        f"experiment      {summary.experiment}\n"
        f"parent run id   {summary.parent_run_id}\n"
        f"tracking URI    {summary.tracking_uri}\n"
        f"dataset hash    {summary.dataset_hash[:16]} "
        f"({'cached' if summary.preprocess_cached else 'built'})\n"
        f"stage seconds   {summary.stage_seconds}\n"
        f"MLflow UI       trainflow ui   (or: mlflow {ui}) -> http://127.0.0.1:5000"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run(args: argparse.Namespace) -> int:
    cfg = build_config(args.preset, args.overrides)  # fail fast, before Prefect starts
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # SIGTERM (kill, a batch system ending us) must cancel the training job like Ctrl-C does;
    # SIGINT is restored too, as a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
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
