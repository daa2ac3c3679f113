"""What the docs tell a user to type is what the command line and the config take: every
`trainflow ...` line of README.md's and docs/*.md's shell blocks parses with the real argument
parser and builds its config (a sweep its grid, a search its space); every config key a page
names in inline code exists, with the value it gives; every TOML block and every experiment
file a page includes loads as an experiment file. A renamed key or flag fails here."""

import argparse
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tests.docs_text import (
    PAGES,
    ROOT,
    SECTIONS,
    Command,
    Setting,
    commands,
    fences,
    prose,
    settings,
)
from trainflow.config_base import StrictModel, submodel
from trainflow.errors import ConfigError
from trainflow.flows.cli import main, parser
from trainflow.flows.config import PipelineConfig, build_config, build_sweep, parse_override
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.space import Param, parse_space
from trainflow.tasks.search.study import StudyRef, make_ref
from trainflow.tasks.train.job_spec import TrainJobSpec

CONFIG_COMMANDS = {"run", "config", "sweep", "cleanup", "ui"}
"""Commands that build a config from a preset, an experiment file and --set."""

EXAMPLE_FILES = {p.name: p for p in sorted((ROOT / "examples").glob("*/*.toml"))}
"""Experiment files the pages run by name (`trainflow run charlm.toml` in its folder)."""


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


def _field(key: str) -> tuple[bool, Any]:
    """Whether dotted `key` is a config key (or a key inside one holding a dict), and the
    field's annotation."""
    model: type[StrictModel] = PipelineConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            return False, None
        ann = info.annotation
        section = submodel(ann)
        if section is not None:
            model = section
            continue
        rest = parts[i + 1 :]
        return (not rest or "dict" in str(ann)), ann
    return True, model


SETTINGS = settings()
_PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|^N$")


def test_the_docs_name_settings() -> None:
    assert len(SETTINGS) >= 150
    assert {s.key.split(".")[0] for s in SETTINGS} >= set(SECTIONS)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s.where} {s.key}")
def test_a_documented_key_exists_and_takes_its_value(setting: Setting) -> None:
    exists, _ = _field(setting.key)
    assert exists, f"{setting.where}: `{setting.key}` is not a config key"
    if setting.value is None or _PLACEHOLDER.search(setting.value):
        return
    if re.fullmatch(r"[a-z]+\(.*\)", setting.value):  # a search space: `train.lr=uniform(0,1)`
        for param in parse_space([f"{setting.key}={setting.value}"]):
            for value in param.samples():
                build_config("tiny", {setting.key: value})
        return
    if setting.toml:
        value = tomllib.loads(f"v = {setting.value}")["v"]
        override: dict[str, Any] = {setting.key: value}
    else:
        override = dict([(setting.key, parse_override(f"k={setting.value}")[1])])
    try:
        build_config("tiny", override)
    except ConfigError as err:
        pytest.fail(f"{setting.where}: `{setting.key}={setting.value}`:\n{err}")


def _toml_fences() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for fence in fences(page):
            if fence.info == "toml":
                out.append((fence.where, fence.body))
            elif fence.info.startswith("{literalinclude}") and fence.info.endswith(".toml"):
                path = (page.parent / fence.info.split()[1]).resolve()
                out.append((fence.where, path.read_text()))
    return out


NOT_EXPERIMENTS = {"project", "tool", "build-system"}
"""Tables of a TOML block that is not an experiment file (pyproject.toml's)."""


@pytest.mark.parametrize("where, text", _toml_fences(), ids=lambda x: str(x)[:40])
def test_a_documented_experiment_file_loads(where: str, text: str, tmp_path: Path) -> None:
    tree = tomllib.loads(text)
    if set(tree) & NOT_EXPERIMENTS:
        return
    path = tmp_path / "shown.toml"
    path.write_text(text)
    try:
        build_config(None, (), path)
    except ConfigError as err:
        pytest.fail(f"{where}: the experiment file shown does not load:\n{err}")


def test_each_example_experiment_file_is_shown_or_named() -> None:
    """Every example project's experiment file appears in the docs (a real file, included or
    run by name), so a user finds all of them."""
    text = "\n".join(page.read_text() for page in PAGES)
    for name, path in EXAMPLE_FILES.items():
        assert name in text or str(path.relative_to(ROOT)) in text, name


def _config_modules(model: type[BaseModel], seen: set[str]) -> set[str]:
    """The modules of `model` and of every model its fields hold, however deeply."""
    seen.add(model.__module__)
    for info in model.model_fields.values():
        for ann in (info.annotation, *typing.get_args(info.annotation)):
            model_type = isinstance(ann, type) and issubclass(ann, BaseModel)
            if model_type and ann.__module__ not in seen:
                _config_modules(ann, seen)
    return seen


def test_the_api_reference_lists_every_config_and_search_type() -> None:
    """Every module holding a config model (a section, and any model a section holds), the
    search's types and a training job's spec has its page in the API reference."""
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    listed = set(re.findall(r"^\s+(trainflow\.[\w.]+)$", index, re.MULTILINE))
    wanted = _config_modules(PipelineConfig, set())
    for public in (SearchConfig, StudyRef, Param, TrainJobSpec):
        wanted |= _config_modules(public, set())
    wanted.discard("trainflow.config_base")
    assert wanted <= listed, f"not in docs/api/index.md: {sorted(wanted - listed)}"


def test_the_experiment_files_shown_are_included_from_real_files() -> None:
    """A page shows an example's experiment file by including it, so what it shows is the file
    the examples' tests run."""
    included = [
        fence.info.split()[1]
        for page in PAGES
        for fence in fences(page)
        if fence.info.startswith("{literalinclude}")
    ]
    assert "../examples/charlm/charlm.toml" in included
    assert "../examples/hf_finetune/finetune_recipe.toml" in included  # docs/training.md
    assert "../examples/image_recipe/resnet.toml" in included


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


def _quoted_keys() -> list[tuple[str, str]]:
    """Dotted config keys written as strings in the pages' code blocks (Python dicts, JSON
    parameters): `{"train.lr": ...}`."""
    pattern = re.compile(rf"\"((?:{'|'.join(SECTIONS)})\.[A-Za-z_][\w.]*)\"")
    return [
        (fence.where, key)
        for page in PAGES
        for fence in fences(page)
        for key in pattern.findall(fence.body)
    ]


@pytest.mark.parametrize("where, key", _quoted_keys(), ids=lambda x: str(x))
def test_a_key_quoted_in_a_code_block_exists(where: str, key: str) -> None:
    assert _field(key)[0], f"{where}: {key!r} is not a config key"


def _leaves(model: type[StrictModel] = PipelineConfig, prefix: str = "") -> dict[str, list[str]]:
    """Leaf name -> the dotted keys that end in it (`lr` -> [`train.lr`])."""
    out: dict[str, list[str]] = {}
    for name, info in model.model_fields.items():
        section = submodel(info.annotation)
        if section is not None:
            for leaf, keys in _leaves(section, f"{prefix}{name}.").items():
                out.setdefault(leaf, []).extend(keys)
        else:
            out.setdefault(name, []).append(prefix + name)
    return out


NOT_TRAINFLOW = {
    "epoch = 3",  # experiments.md's example of a file with mistakes (its output checked above)
    "lr = -1",
    "default_permission = READ",  # production.md: MLflow's basic_auth.ini
    "default_permission = NO_PERMISSIONS",
}
"""`key = value` spans of the pages that are not lines of a valid experiment file."""


def _toml_spans() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for number, line in enumerate(prose(page).splitlines(), start=1):
            for span in re.findall(r"(?<!`)`([A-Za-z_]\w* = [^`]+)`(?!`)", line):
                out.append((f"{page.relative_to(ROOT)}:{number}", span))
    return out


@pytest.mark.parametrize("where, span", _toml_spans(), ids=lambda x: str(x))
def test_a_documented_toml_line_sets_a_key_of_a_file(where: str, span: str) -> None:
    """`registered_model = false`, `model_args = { dim = 64 }`: a line of an experiment file,
    inside its section: the key is a config key and takes the value."""
    name, value = (part.strip() for part in span.split("=", 1))
    keys = _leaves().get(name, [])
    if span in NOT_TRAINFLOW:
        return
    if name == "preset":
        build_config(tomllib.loads(span)["preset"])
        return
    assert len(keys) == 1, f"{where}: `{span}`: {name} is no config key of one section ({keys})"
    build_config("tiny", {keys[0]: tomllib.loads(f"v = {value}")["v"]})


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


UNKNOWN_ON_PURPOSE = {"train.foo"}
"""Keys the pages show being refused (an error message's example)."""


def _keys_in_prose() -> list[tuple[str, str]]:
    """Every dotted config key anywhere in the prose's inline code, messages quoted whole
    included (`cluster.cpus_per_task=<c> with cluster.ranks_per_node=<r> ...`)."""
    key = re.compile(rf"(?<![\w/.-])((?:{'|'.join(SECTIONS)})\.[A-Za-z_][\w.]*\w)")
    return [
        (f"{page.relative_to(ROOT)}:{number}", found)
        for page in PAGES
        for number, line in enumerate(prose(page).splitlines(), start=1)
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", line)
        for found in key.findall(span)
    ]


def test_every_key_in_the_prose_exists() -> None:
    keys = _keys_in_prose()
    assert len(keys) >= 200
    wrong = [f"{where}: {key}" for where, key in keys if not _field(key)[0]]
    assert [w for w in wrong if w.rsplit(" ", 1)[1] not in UNKNOWN_ON_PURPOSE] == []
