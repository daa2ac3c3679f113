"""Each stage folder of tasks/ is readable from its `__init__` docstring: a map of its modules
and sub-packages (each sub-package maps its own).

The map lists each module once, one line each, under "Modules:"; a module added, renamed or
removed without its line fails here, so the map never points at what is not there.
"""

import ast
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[2] / "tasks"
STAGES = ["preprocess", "train", "evaluate", "tracking", "objectives", "search"]


def mapped(folder: Path) -> list[str]:
    """The module names listed under "Modules:" in the folder's `__init__` docstring."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    _, found, section = doc.partition("\nModules:\n")
    assert found, f"{folder.name}/__init__.py's docstring has no 'Modules:' section"
    lines = [line for line in section.splitlines() if line.strip()]
    return [line.split()[0] for line in lines if line.startswith("    ")]


def _folders() -> list[str]:
    """The stages and their sub-packages (each maps its own modules and sub-packages)."""
    found = []
    for stage in STAGES:
        found += [stage] + [
            f"{stage}/{p.parent.name}" for p in sorted((TASKS / stage).glob("*/__init__.py"))
        ]
    return found


@pytest.mark.parametrize("stage", _folders())
def test_the_stage_docstring_maps_its_modules(stage: str) -> None:
    folder = TASKS / stage
    listed = mapped(folder)
    modules = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    present = sorted(modules + [p.parent.name for p in folder.glob("*/__init__.py")])
    assert len(listed) == len(set(listed)), f"{stage}: a module listed twice: {listed}"
    unmapped = sorted(set(present) - set(listed))
    stale = sorted(set(listed) - set(present) - {"__init__"})
    assert not unmapped and not stale, (
        f"{stage}/__init__.py's map lacks {unmapped} and names {stale}, which are not there"
    )


def test_a_missing_line_is_found(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""A stage.\n\nModules:\n    a   does a.\n"""\n')
    assert mapped(tmp_path) == ["a"]
