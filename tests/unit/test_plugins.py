"""The one resolver every seam uses: each way a user's reference or code fails is one line that
names the setting, the user's file and the fix."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainflow.tasks.plugins import PluginError, call, resolve

_BUILTINS = {"builtin": "trainflow.tasks.spec:DataSpec"}


def _resolve(ref: str):
    return resolve(ref, setting="train.model", group="trainflow.models", builtins=_BUILTINS)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "good_models.py").write_text(
        "WIDTH = 3\n\ndef build(depth=1):\n    if depth < 0:\n        raise ValueError('no')\n"
        "    return depth\n"
    )
    (tmp_path / "broken_models.py").write_text("import torch\nx = 1 / 0\n")
    (tmp_path / "needs_dep.py").write_text("import not_installed_anywhere\n")
    yield tmp_path
    for name in ("good_models", "broken_models", "needs_dep"):
        sys.modules.pop(name, None)  # each test imports its own project's files


def test_builtins_and_import_paths_resolve(project: Path) -> None:
    assert _resolve("builtin").target == "trainflow.tasks.spec:DataSpec"
    found = _resolve("good_models:build")
    assert found.file == str(project / "good_models.py")
    assert call(found, "the factory", depth=4) == 4


@pytest.mark.parametrize(
    ("ref", "needles"),
    [
        ("nowhere_at_all:build", ["no module named 'nowhere_at_all'", "PYTHONPATH"]),
        ("needs_dep:build", ["needs_dep.py:1", "'not_installed_anywhere'", "pip install"]),
        ("broken_models:build", ["ZeroDivisionError", "broken_models.py:2"]),
        ("good_models:missing", ["good_models.py has no 'missing'"]),
        ("good_models:WIDTH", ["'WIDTH'", "is a int, not a callable"]),
        ("plain_name", ["not a built-in (builtin)", "'trainflow.models'"]),
    ],
)
def test_each_mistake_is_one_line_naming_the_file(
    project: Path, ref: str, needles: list[str]
) -> None:
    with pytest.raises(PluginError) as err:
        _resolve(ref)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"train.model={ref!r}")
    for needle in needles:
        assert needle in message, message


def test_an_exception_in_the_factory_names_its_line(project: Path) -> None:
    with pytest.raises(PluginError) as err:
        call(_resolve("good_models:build"), "the model factory 'good_models:build'", depth=-1)
    message = str(err.value)
    assert "ValueError: no" in message and f"{project / 'good_models.py'}:5" in message
