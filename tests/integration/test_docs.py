"""The documentation site builds as `make docs` builds it: Sphinx with warnings as errors, so a
broken cross-reference, a missing page in a toctree, a missing image or a docstring the API
reference cannot render fails the suite. The command-line reference holds every command and
option of the real parser. (What the pages' commands and keys say is checked against the
parser and the config in tests/unit/test_docs_commands.py, test_docs_keys.py and
test_docs_experiments.py, without Sphinx.)"""

import argparse
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow.flows.cli import parser

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPHINX = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]


def _build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SPHINX, "-d", str(out / ".doctrees"), str(source), str(out / "html")],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_docs_build_without_warnings(tmp_path: Path) -> None:
    built = _build(ROOT / "docs", tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    html = tmp_path / "html"
    assert (html / "index.html").is_file()
    for page in ("install", "troubleshooting", "performance", "architecture"):
        assert (html / f"{page}.html").is_file(), page
    # The API reference is generated from the docstrings, one page per module.
    api = (html / "api" / "generated" / "trainflow.tasks.train.config.html").read_text()
    assert "TrainConfig" in api and "Passes over the training split." in api
    assert (html / "_images" / "mlflow-train-run.png").is_file()
    search = (html / "api" / "generated" / "trainflow.tasks.search.study.html").read_text()
    assert "StudyRef" in search
    _has_every_option(html / "cli.html")


def _has_every_option(page: Path) -> None:
    """The command-line reference, generated from the parser, shows each of its commands with
    each option and its help."""
    text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
    top = parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(commands.choices) >= 7
    for name, command in commands.choices.items():
        assert f"trainflow {name} [-h]" in text, name
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue  # -h: the reference is the help
            for flag in action.option_strings:
                assert flag in text, (name, flag)
            if action.help and action.help != argparse.SUPPRESS:
                assert " ".join(action.help.split()) in " ".join(text.split()), (name, action.help)


def test_a_broken_reference_fails_the_build(tmp_path: Path) -> None:
    """The check can fail: the same configuration on a page that links to a missing one."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "conf.py").write_text((ROOT / "docs" / "conf.py").read_text())
    (source / "index.md").write_text("# Index\n\nSee [the missing page](missing.md).\n")
    built = _build(source, tmp_path / "out")
    assert built.returncode != 0
    assert "missing.md" in built.stdout + built.stderr
