"""What the pages say about the project beyond commands and keys is what the project holds:
deployments as deploy/prefect.yaml has them, the extras pyproject.toml names, the metrics a
search reports, the sbatch options refused, and figures only on the performance page, each
with its bench/results file."""

import importlib
import inspect
import json
import re
import tomllib
from typing import Any

import pytest
import yaml

from tests.docs_text import PAGES, ROOT, Command, commands
from trainflow.errors import ConfigError
from trainflow.flows.config import build_config
from trainflow.tasks.objectives import BUILTINS


def test_install_commands_quote_extras() -> None:
    """`pip install trainflow[hf]` unquoted is a glob to zsh ("no matches found")."""
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            for unquoted in re.findall(r"pip install [^'\"\s]*\[[^\]]*\]", line):
                pytest.fail(f"{page.relative_to(ROOT)}:{number}: quote it: {unquoted}")


def _flow_parameters(entrypoint: str) -> tuple[str, list[str]]:
    """The flow's name and parameters of a prefect.yaml entrypoint (`flows/x.py:function`)."""
    path, function = entrypoint.split(":")
    module = importlib.import_module("trainflow." + path.removesuffix(".py").replace("/", "."))
    flow = getattr(module, function)
    return flow.name, list(inspect.signature(flow.fn).parameters)


def _as_yaml(value: Any) -> str:
    """`value` as YAML writes it inline: null, {}, 16, tpe."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def test_the_deployments_table_is_prefect_yaml() -> None:
    """docs/deployments.md's table gives every deployment of deploy/prefect.yaml with each of
    its parameters and default as the file has them, and a deployment run by hand (adhoc)
    offers every parameter of its flow."""
    deployments = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]
    page = (ROOT / "docs" / "deployments.md").read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| `([\w-]+/[\w-]+)` \|[^|]*\|(.*)\|$", page, re.M)}
    assert len(rows) == len(deployments), rows
    for deployment in deployments:
        flow, parameters = _flow_parameters(deployment["entrypoint"])
        row = rows[f"{flow}/{deployment['name']}"]
        shown = dict(re.findall(r"`(\w+): ([^`]*)`", row))
        given = {k: _as_yaml(v) for k, v in deployment["parameters"].items()}
        assert shown == given, (flow, deployment["name"])
        assert set(given) <= set(parameters)
        if deployment["name"] == "adhoc":
            assert set(given) == set(parameters), (flow, set(parameters) - set(given))


DEPLOYMENT_RUNS = [c for c in commands("prefect") if c.argv[:2] == ["deployment", "run"]]


def test_the_docs_show_deployment_runs() -> None:
    assert len(DEPLOYMENT_RUNS) >= 6


@pytest.mark.parametrize("command", DEPLOYMENT_RUNS, ids=lambda c: f"{c.where} {c.text[:50]}")
def test_a_documented_deployment_run_passes_its_flow_parameters(command: Command) -> None:
    """`prefect deployment run <flow>/<deployment> --param k=v`: the deployment is in
    prefect.yaml, each k is a parameter of its flow, and the overrides build a config."""
    deployments = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]
    flows = {}
    for deployment in deployments:
        flow, parameters = _flow_parameters(deployment["entrypoint"])
        flows[f"{flow}/{deployment['name']}"] = parameters
    name, *rest = command.argv[2:]
    assert name in flows, f"{command.where}: no deployment {name} in deploy/prefect.yaml"
    params: dict[str, str] = {}
    words = iter(rest)
    for word in words:
        if word == "--param":
            key, _, value = next(words).partition("=")
            params[key] = value
    assert set(params) <= set(flows[name]), f"{command.where}: {set(params) - set(flows[name])}"
    overrides = json.loads(params.get("overrides", "{}"))
    preset = params.get("preset")
    if "experiment" not in params:  # a path on the worker's machine
        build_config(preset, overrides)


def test_the_search_page_names_each_objectives_metric() -> None:
    """docs/search.md says which validation metric a search reports and prunes on, for every
    built-in objective: the one the search asks the pruner about (val_ + the objective's
    select metric)."""
    text = " ".join((ROOT / "docs" / "search.md").read_text().split())
    for name, ref in BUILTINS.items():
        module, cls = ref.split(":")
        metric = f"val_{getattr(importlib.import_module(module), cls).select}"
        said = re.search(rf"`{metric}` for ([a-z, ]+?)[,;)]", text)
        assert said and name in said.group(1), (name, metric)


def test_the_install_page_names_every_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    page = (ROOT / "docs" / "install.md").read_text()
    for extra in extras:
        assert f"\n| `{extra}` |" in page, extra


def test_the_sbatch_options_said_refused_are_refused() -> None:
    """where-it-runs.md names GPU options that sbatch_extra refuses, and what to set instead."""
    text = " ".join((ROOT / "docs" / "where-it-runs.md").read_text().split())
    said = re.search(r"Options that trainflow sets from the fields are refused there.*?\. ", text)
    assert said and "(`cluster.gpus_per_node`)" in said.group(0)
    for option in re.findall(r"`(\w+)`", said.group(0).split("(`cluster.gpus_per_node`)")[0]):
        with pytest.raises(ConfigError, match=r"use cluster\.gpus_per_node instead"):
            build_config("tiny", {"cluster.sbatch_extra": {option: "gpu:a100:4"}})


NARRATION = re.compile(
    r"not run yet|recorded before|test machine|\bthis session|µs\b|\bload \d|\bmeasured:",
    re.IGNORECASE,
)
"""What belongs on the performance page (figures and their machines) or in git history (what
was recorded when), not on a user page."""
BENCH = re.compile(r"bench/results|python -m bench")
"""A benchmark quoted: only the performance page quotes them (contributing says how they are
run, architecture where they lie)."""


def test_figures_and_narration_stay_off_the_user_pages() -> None:
    for page in PAGES:
        if page.name == "performance.md":
            continue
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            found = NARRATION.search(line)
            if page.name not in ("contributing.md", "architecture.md"):
                found = found or BENCH.search(line)
            assert not found, f"{page.relative_to(ROOT)}:{number}: {found.group(0)!r}: {line}"


def test_each_figure_on_the_performance_page_names_its_result_file() -> None:
    """Every section of the performance page that gives figures (a table of numbers) names the
    bench/results file they come from, and that file exists."""
    text = (ROOT / "docs" / "performance.md").read_text()
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title = section.splitlines()[0]
        figures = re.search(r"^\|[^\n]*\d[^\n]*\|$", section, re.MULTILINE)
        if not figures or title.startswith("Other"):
            continue
        files = re.findall(r"`(?:bench/results/)?([\w.-]+\.json)`", section)
        assert files, f"performance.md, {title}: figures without their bench/results file"
        for file in files:
            assert (ROOT / "bench" / "results" / file).is_file(), (title, file)
