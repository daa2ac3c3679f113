"""Every TOML block a page shows and every experiment file it includes loads as an experiment
file; every example project's experiment file is shown or named, and the pages show them by
including the real files. A renamed key of a file fails here."""

import tomllib
from pathlib import Path

import pytest

from tests.docs_text import EXAMPLE_FILES, PAGES, ROOT, fences
from trainflow.errors import ConfigError
from trainflow.flows.config import build_config


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
