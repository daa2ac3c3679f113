"""What the docs tell a user to type is what the command line takes: every `trainflow ...`
line of README.md's and docs/*.md's shell blocks (and every documented `sbatch` pipeline job)
parses with the real argument parser and builds its config (a sweep its grid, a search its
space); every command named in the prose has the options it names; the error examples are
what the commands print. A renamed command or flag fails here. (Config keys:
test_docs_keys.py; TOML blocks and experiment files: test_docs_experiments.py.)"""

import argparse
import re
from pathlib import Path

import pytest

from tests.docs_text import EXAMPLE_FILES, PAGES, ROOT, Command, commands, fences, prose
from trainflow.errors import ConfigError
from trainflow.flows.cli import main, parser
from trainflow.flows.config import build_config, build_sweep, parse_override
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.space import parse_space
from trainflow.tasks.search.study import make_ref

CONFIG_COMMANDS = {"run", "config", "sweep", "cleanup", "ui"}
"""Commands that build a config from a preset, an experiment file and --set."""


def _experiment(name: str, tmp: Path) -> Path:
    """The file a documented command runs: an example's own file, else (a name standing for
    the reader's file, `experiment.toml`) an empty file, which starts from the demo preset."""
    if Path(name).name in EXAMPLE_FILES:
        return EXAMPLE_FILES[Path(name).name]
    stand_in = tmp / "experiment.toml"
    stand_in.write_text("")
    return stand_in


def _strict_parser() -> argparse.ArgumentParser:
    """trainflow's parser taking options only as spelled (argparse takes `--trial` for
    `--trials`: a page must give the option's whole name)."""
    top = parser()
    subcommands = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    for each in [top, *(p for a in subcommands for p in a.choices.values())]:
        each.allow_abbrev = False
    return top


def _args(command: Command) -> argparse.Namespace:
    argv = [a for a in command.argv if a != "..."]  # `trainflow --debug run ...`
    try:
        return _strict_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{command.where}: `{command.text}` is refused by trainflow's parser")


def _reader_paths(overrides: list[str], tmp: Path) -> list[str]:
    """The overrides with each absolute path that a page gives as the reader's own
    (`preprocess.path=/data/imgs`) made a folder under `tmp`: the config checks it exists."""
    out = []
    for text in overrides:
        key, _, value = text.partition("=")
        if value.startswith("/") and not Path(value).exists():
            value = str(tmp / value.lstrip("/"))
            Path(value).mkdir(parents=True)
        out.append(f"{key}={value}")
    return out


def _build(command: Command, args: argparse.Namespace, tmp: Path) -> None:
    """Build what the command would build before any work starts."""
    experiment = _experiment(args.experiment, tmp) if args.experiment else None
    args.overrides = _reader_paths(args.overrides, tmp)
    if args.command != "sweep":
        build_config(args.preset, args.overrides, experiment)
    elif args.grid:
        grid = {".".join(path): value for path, value in map(parse_override, args.grid)}
        build_sweep(args.preset, args.overrides, grid, experiment)
    else:
        space = {p.key: p.text() for p in parse_space(args.space)}
        search = SearchConfig(space=space, trials=args.trials, parallel=args.parallel)
        search = search.model_copy(update={"storage": args.storage, "seed": args.seed})
        base = build_config(args.preset, args.overrides, experiment)
        make_ref(search, tmp, base.cluster.executor, base.name, "val_accuracy", True)
        for param in parse_space(search.space):
            for value in param.samples():
                build_config(args.preset, [*args.overrides, f"{param.key}={value}"], experiment)


COMMANDS = commands()


def test_the_docs_show_the_commands() -> None:
    """The reader's list is found (a change to how pages are read cannot empty it)."""
    assert len(COMMANDS) >= 30, [c.text for c in COMMANDS]
    shown = {c.argv[0] for c in COMMANDS if c.argv}
    assert {"run", "config", "sweep", "ui", "cleanup", "presets", "cluster"} <= shown


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where} {c.text[:60]}")
def test_a_documented_command_parses_and_builds_its_config(
    command: Command, tmp_path: Path
) -> None:
    args = _args(command)
    if args.command == "presets":
        assert main(["presets"]) == 0
    if args.command not in CONFIG_COMMANDS:
        return
    try:
        _build(command, args, tmp_path)
    except ConfigError as err:
        pytest.fail(f"{command.where}: `{command.text}`:\n{err}")
    if args.command == "config":  # cheap: run it as the page shows it
        argv = ["config", "--format", args.format, *(["--preset", args.preset] * bool(args.preset))]
        argv += [word for o in args.overrides for word in ("--set", o)]
        argv += [str(_experiment(args.experiment, tmp_path))] if args.experiment else []
        assert main(argv) == 0, command.text


def test_the_mistakes_example_is_what_the_command_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """experiments.md's error example is the real output for the file it names, with the edits
    it names: line numbers, values and wording."""
    page = ROOT / "docs" / "experiments.md"
    assert "The file above with `epoch = 3` and `lr = -1`:" in page.read_text()
    (shown,) = [f.body for f in fences(page) if f.body.startswith("trainflow: error:")]
    original = (ROOT / "examples" / "charlm" / "charlm.toml").read_text()
    edited = original.replace("\nepochs = 3\n", "\nepoch = 3\n").replace("\nlr = 2e-3", "\nlr = -1")
    assert edited.count("epoch = 3") == 1 and "lr = -1" in edited
    (tmp_path / "charlm.toml").write_text(edited)
    monkeypatch.chdir(tmp_path)
    assert main(["config", "charlm.toml"]) == 2
    _same_output(shown, capsys.readouterr().err)


def _same_output(shown: str, printed: str) -> None:
    """A page's output example is what was printed, line by line; a shown line that ends in
    `, ...` is the start of the printed one."""
    assert len(printed.splitlines()) == len(shown.splitlines()), printed
    for doc, real in zip(shown.splitlines(), printed.splitlines(), strict=True):
        if doc.endswith(", ..."):
            assert real.startswith(doc.removesuffix(" ...")), (doc, real)
        else:
            assert doc == real


def test_the_config_error_example_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """run.md's example of a refused config is the real output of the two mistakes it shows."""
    page = ROOT / "docs" / "run.md"
    (shown,) = [f.body for f in fences(page) if f.body.startswith("trainflow: error:")]
    assert main(["config", "--set", "train.precision=fp8", "--set", "train.foo=1"]) == 2
    _same_output(shown, capsys.readouterr().err)


def test_one_command_list_in_the_docs() -> None:
    """The commands are listed once, on docs/run.md; the README keeps a short sample (checked
    above with the rest) and links to the list and to the reference."""
    readme = [c for c in COMMANDS if c.where.startswith("README.md")]
    assert 0 < len(readme) <= 3, [c.text for c in readme]
    front = (ROOT / "README.md").read_text()
    assert "(docs/run.md#commands)" in front and "(docs/cli.md)" in front
    assert len(front.splitlines()) <= 300


PIPELINE_JOBS = [
    Command(c.where, c.text, ["run", *c.argv[i + 1 :]])
    for c in commands("sbatch")
    for i, word in enumerate(c.argv)
    if word.endswith("/pipeline.sbatch")
]
"""Documented `sbatch deploy/slurm/pipeline.sbatch ARGS`: the job runs `trainflow run ARGS`."""


def test_the_docs_show_pipeline_jobs() -> None:
    assert len(PIPELINE_JOBS) >= 4


@pytest.mark.parametrize("command", PIPELINE_JOBS, ids=lambda c: f"{c.where} {c.text[:50]}")
def test_a_documented_pipeline_job_builds_its_config(command: Command, tmp_path: Path) -> None:
    _build(command, _args(command), tmp_path)


def _inline_commands() -> list[tuple[str, str]]:
    """`trainflow ...` named in inline code in the pages' prose."""
    return [
        (f"{page.relative_to(ROOT)}:{number}", span)
        for page in PAGES
        for number, line in enumerate(prose(page).splitlines(), start=1)
        for span in re.findall(r"(?<!`)`(trainflow [^`]+)`(?!`)", line)
    ]


@pytest.mark.parametrize("where, text", _inline_commands(), ids=lambda x: str(x))
def test_a_command_named_in_prose_has_its_options(where: str, text: str) -> None:
    """`trainflow sweep --space`, `trainflow ui --port <free port>`: the command exists and
    has each option named (spelled whole)."""
    top = parser()
    (subcommands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    words = text.split()[1:]
    name = next((w for w in words if not w.startswith("-")), None)
    if name in (None, "...", "<command>"):
        command = top
    else:
        assert name in subcommands.choices, f"{where}: `{text}`: no command {name!r}"
        command = subcommands.choices[name]
    options = {s for a in [*top._actions, *command._actions] for s in a.option_strings}
    for word in words:
        if word.startswith("--"):
            assert word.split("=")[0] in options, f"{where}: `{text}`: no option {word}"
