"""Every config key the docs name exists and takes the value they give it: keys in the prose's
inline code (`train.lr=3e-4`, messages quoted whole), keys quoted in code blocks, `key = value`
lines of an experiment file; and every config module has its page in the API reference. A
renamed key fails here."""

import re
import tomllib
import typing
from typing import Any

import pytest
from pydantic import BaseModel

from tests.docs_text import PAGES, ROOT, SECTIONS, Setting, fences, prose, settings
from trainflow.config_base import StrictModel, submodel
from trainflow.errors import ConfigError
from trainflow.flows.config import PipelineConfig, build_config, parse_override
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.space import Param, parse_space
from trainflow.tasks.search.study import StudyRef
from trainflow.tasks.train.job_spec import TrainJobSpec


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
    "epoch = 3",  # experiments.md's file with mistakes (its output: test_docs_commands)
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
