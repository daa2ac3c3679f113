"""trainflow under its own name: installed (editable, as `make setup` does, or as a wheel, as
`pip install .` does) its code is `trainflow.*` and never top-level `tasks`, `flows` or `cluster`,
so a user project with its own `tasks.py` and `cluster/` runs a whole pipeline."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"flows": "trainflow.flows", "tasks": "trainflow.tasks", "cluster": "trainflow.cluster"}

# What a user's own project often holds: names that trainflow's folders once took.
_PROBE = """
import sys
import tasks, cluster
import trainflow.tasks.train.job, trainflow.cluster.executor, trainflow.flows.cli
assert tasks.OWNER == "user" and cluster.OWNER == "user", (tasks, cluster)
try:
    import flows
except ImportError:
    pass
else:
    raise SystemExit(f"top-level flows importable: {flows}")
print(trainflow.tasks.train.job.__file__)
"""


def _user_project(tmp_path: Path) -> Path:
    project = tmp_path / "user project"
    (project / "cluster").mkdir(parents=True)
    (project / "tasks.py").write_text('OWNER = "user"\nHIDDEN = 8\n')
    (project / "cluster" / "__init__.py").write_text('OWNER = "user"\n')
    return project


def test_the_package_list_names_every_package_folder() -> None:
    """pyproject lists packages by hand (package-dir mappings need it): a new package folder
    missing from the list would be absent from a wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"trainflow"}
    for folder, name in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert set(setuptools["packages"]) == found
    assert {setuptools["package-dir"][name] for name in MAPPED.values()} == set(MAPPED)


def test_editable_install_beside_a_user_project_with_its_own_tasks_and_cluster(
    tmp_path: Path,
) -> None:
    project = _user_project(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr


def test_a_wheel_install_holds_trainflow_only(tmp_path: Path) -> None:
    """`pip install .` (here uv, with no dependencies: they come from this venv's site-packages,
    which holds no trainflow folder of its own, only the editable install's finder)."""
    venv, source = tmp_path / "venv", tmp_path / "source"
    uv = Path(sys.executable).with_name("uv")
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in ("trainflow", *MAPPED):
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=skip)
    subprocess.run([uv, "venv", "-q", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", python, "--no-deps", source],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    site = Path(
        subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"])
        .decode()
        .strip()
    )
    assert sorted(p.name for p in site.iterdir() if p.name.startswith(("trainflow", *MAPPED))) == [
        "trainflow",
        "trainflow-0.1.0.dist-info",
    ]
    assert (site / "trainflow" / "cluster" / "dev" / "slurm-lib" / "daemons.sh").is_file()
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    out = subprocess.run(
        [python, "-c", _PROBE],
        cwd=_user_project(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site / "trainflow")), out.stdout


def test_a_pipeline_runs_from_a_user_project_with_its_own_tasks_and_cluster(
    tmp_path: Path,
) -> None:
    """...and trains the user's own model: a factory in my_models.py that imports the user's
    tasks.py, found in the folder `trainflow run` starts in, snapshotted and run from the copy."""
    project = _user_project(tmp_path)
    (project / "my_models.py").write_text(_MY_MODELS)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trainflow = str(Path(sys.executable).with_name("trainflow"))
    argv = [trainflow, "run", "--preset", "tiny", "--set", f"workdir={tmp_path / 'work'}"]
    argv += ["--set", "train.model=my_models:build", "--set", 'train.model_args={"depth": 2}']
    argv += ["--set", f"tracking.tracking_uri={store}"]
    out = subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "== trainflow summary ==" in out.stdout, out.stdout[-3000:]
    assert "test accuracy" in out.stdout
    expected = 256 * 8 + 8 + 8 * 8 + 8 + 8 * 4 + 4  # 1x16x16 synthetic images, 4 classes
    assert f"model my_models:build: {expected:,} parameters" in out.stdout

    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    [train] = [r for r in runs if r.info.run_name == "train"]
    assert train.data.params["model_args.depth"] == "2"
    assert train.data.params["model_parameters"] == str(expected)
    sha = parent.data.tags["code_snapshot_hash"]
    [evaluate] = [r for r in runs if r.info.run_name == "evaluate"]
    assert train.data.tags["code_snapshot_hash"] == evaluate.data.tags["code_snapshot_hash"] == sha
    [version] = client.search_model_versions()
    assert version.tags["code_snapshot_hash"] == sha  # the registered model names its code
    logged = {f.path for f in client.list_artifacts(parent.info.run_id, "code/0")}
    assert {"code/0/my_models.py", "code/0/tasks.py"} <= logged
    # Each rank built the model from the snapshot in the run's job folder, not the project.
    snapshot = tmp_path / "work" / "runs" / parent.info.run_id / "jobs" / "code" / "0"
    built = re.findall(r"\[rank\d[^]]*\] built by (\S+) owned by (\w+)", out.stdout + out.stderr)
    assert built and set(built) == {(str(snapshot / "my_models.py"), "user")}, built


_MY_MODELS = """\
import math

from torch import nn

from tasks import HIDDEN, OWNER


def build(spec, depth=1):
    print(f"built by {__file__} owned by {OWNER}", flush=True)
    width, layers = math.prod(spec.sample_shape), [nn.Flatten()]
    for _ in range(depth):
        layers += [nn.Linear(width, HIDDEN), nn.ReLU()]
        width = HIDDEN
    return nn.Sequential(*layers, nn.Linear(width, spec.num_classes))
"""
