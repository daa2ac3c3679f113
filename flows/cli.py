"""The ``trainflow`` command line: the parser and the dispatch to each command (the bodies of
those that run flows or act on jobs are flows.commands)."""

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from trainflow import gc_policy
from trainflow.errors import DEBUG_ENV, JobError, TrainflowError, debug_enabled
from trainflow.flows import commands
from trainflow.flows.config import PRESETS, PipelineConfig
from trainflow.flows.ui_command import serve_ui
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
        "what may change: a longer train.epochs or train.max_steps, the checkpoint and log "
        "step cadences, the hang and straggler allowances, cluster.* (repeatable)",
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
            cfg = commands.config_of(args)
            if args.format == "toml":
                from trainflow.flows.experiment import render

                print(render(cfg), end="")
            else:
                print(cfg.model_dump_json(indent=2))
            return 0
        if args.command == "sweep":
            return commands.sweep(args)
        if args.command == "cluster":
            from trainflow.cluster.dev.slurm import run as slurm

            return slurm(args.action, nodes=args.nodes, fresh=args.fresh)
        if args.command == "resume":
            return commands.resume(args)
        if args.command == "cleanup":
            return commands.cleanup(commands.config_of(args))
        if args.command == "ui":
            return serve_ui(commands.config_of(args), args.host, args.port)
        return commands.run(args)
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
    gc_policy.at_start()
    try:
        code = main()
    finally:
        gc_policy.before_exit()  # the interpreter's teardown then collects nothing
    sys.exit(code)


if __name__ == "__main__":
    entry()
