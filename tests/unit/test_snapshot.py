"""What a run's code snapshot holds, and that the snapshot, not the live folder, is imported."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
from distributed import Client, LocalCluster

from trainflow.cluster import snapshot
from trainflow.cluster.dask_snapshot import register_snapshot
from trainflow.cluster.snapshot import code_path, plan_snapshot, snapshot_for_jobs, take_snapshot
from trainflow.errors import ConfigError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # dask workers need not import it


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A user project: a top-level module importing its sibling tasks.py, a package, data."""
    root = tmp_path / "proj"
    (root / "nets" / "blocks").mkdir(parents=True)
    (root / "my_models.py").write_text("from tasks import VALUE\n")
    (root / "tasks.py").write_text("VALUE = 'submitted'\n")
    (root / "notes.txt").write_text("not code\n")
    (root / "nets" / "__init__.py").write_text("")
    (root / "nets" / "blocks" / "__init__.py").write_text("")
    (root / "nets" / "blocks" / "mlp.py").write_text("DEPTH = 2\n")
    (root / "nets" / "table.json").write_text("{}\n")
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in ("my_models", "tasks", "nets", "nets.blocks", "nets.blocks.mlp"):
        sys.modules.pop(name, None)


def _files(modules: list[str]) -> dict[Path, list[str]]:
    return plan_snapshot(modules).roots


def test_without_git_a_module_brings_its_sibling_py_files(project: Path) -> None:
    assert _files(["my_models"]) == {project: ["my_models.py", "tasks.py"]}


def test_without_git_a_package_module_brings_its_top_level_package(project: Path) -> None:
    assert _files(["nets.blocks.mlp"]) == {
        project: [
            "nets/__init__.py",
            "nets/blocks/__init__.py",
            "nets/blocks/mlp.py",
            "nets/table.json",
        ]
    }


def test_in_git_the_files_git_knows_of_not_the_ignored_ones(project: Path) -> None:
    (project / ".gitignore").write_text("*.json\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([*git, "add", "my_models.py", ".gitignore"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=project, check=True)
    files = _files(["my_models"])[project]
    assert ".gitignore" in files and "my_models.py" in files
    assert "tasks.py" in files and "notes.txt" in files  # untracked, not ignored: kept
    assert "nets/table.json" not in files


def test_installed_and_trainflows_own_modules_are_not_snapshotted(project: Path) -> None:
    assert _files(["pytest", "json", "trainflow.tasks.train.models"]) == {}
    # A project inside a trainflow checkout: its modules are copied, trainflow's folder never.
    (project / "trainflow").mkdir()
    (project / "trainflow" / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    files = _files(["my_models"])[project]
    assert "my_models.py" in files and not any(f.startswith("trainflow") for f in files)


def test_a_snapshot_too_big_is_refused_in_one_line(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "MAX_SNAPSHOT_BYTES", 10)
    with pytest.raises(ConfigError) as err:
        plan_snapshot(["my_models"])
    assert "\n" not in str(err.value) and str(project) in str(err.value)
    assert ".gitignore" in str(err.value)


def test_the_snapshot_is_imported_not_the_edited_files(project: Path, tmp_path: Path) -> None:
    code = snapshot_for_jobs(["my_models"], tmp_path / "jobs")
    assert code is not None and code.folder == tmp_path / "jobs" / "code"
    assert os.stat(tmp_path / "jobs").st_mode & 0o077 == 0  # private, like the job's pickle
    (project / "tasks.py").write_text("VALUE = 'edited after submission'\n")
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT, *map(str, code.paths)],
        capture_output=True,
        text=True,
        cwd=project,  # the live folder is the working folder too: the snapshot still wins
        env={**os.environ, "PYTHONPATH": str(project)},
        check=True,
    )
    assert out.stdout.strip() == "submitted"
    again = take_snapshot(plan_snapshot(["my_models"]), tmp_path / "again")
    assert again is not None and again.sha256 != code.sha256  # the edit changes the hash


_IMPORT = """\
import sys
from pathlib import Path
from trainflow.cluster.snapshot import code_first
code_first([Path(p) for p in sys.argv[1:]])
import my_models
print(my_models.VALUE)
"""


def _value() -> str:
    import my_models

    return str(my_models.VALUE)


@pytest.mark.services
def test_dask_workers_import_the_snapshot_first(project: Path, tmp_path: Path) -> None:
    code = snapshot_for_jobs(["my_models"], tmp_path / "jobs")
    assert code is not None
    (project / "tasks.py").write_text("VALUE = 'edited after submission'\n")
    env = {"PYTHONPATH": str(project)}  # the worker could import the live folder
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True, env=env) as cluster,
        Client(cluster) as client,
    ):
        register_snapshot(client, code.paths)
        assert client.submit(_value, pure=False).result(timeout=120) == "submitted"


def test_code_path_restores_sys_path(tmp_path: Path) -> None:
    before = list(sys.path)
    with code_path([tmp_path]):
        assert sys.path[0] == str(tmp_path)
    assert sys.path == before


def test_a_user_project_inside_trainflows_checkout_is_the_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """examples/ lives in trainflow's repo but is a user's project: only trainflow's package
    folders count as trainflow's own (the repo root once did, and examples ran unsnapshotted)."""
    folder = Path(__file__).resolve().parents[2] / "examples" / "diabetes"
    monkeypatch.syspath_prepend(str(folder))
    try:
        roots = _files(["diabetes_mlp"])
    finally:
        sys.modules.pop("diabetes_mlp", None)
    assert {"diabetes_mlp.py", "diabetes_source.py"} <= set(roots[folder])
    assert not _files(["trainflow.tasks.spec", "trainflow.cluster.snapshot"])
