"""The two user projects in examples/, run as a user runs them: `trainflow run` in the project's
folder, their own model factory and source plug-in on real data no one on the team wrote, a
regression (scikit-learn's bundled diabetes CSV, MLP) and a sequence objective (the standard
library's source files, a character transformer). Short runs: they prove the path and that
the model learns."""

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
from mlflow.entities import FileInfo, Run
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class Example(NamedTuple):
    folder: str
    experiment: str
    """The example's experiment file, in its folder."""
    model: str
    """The model factory the file names."""
    shorter: list[str]
    """--set items that make the example's run test-sized."""
    metrics: set[str]
    artifacts: set[str]
    headline: str
    user_files: set[str]
    on_slurm_only: bool = False
    """Run by its own test on the dev Slurm only (tests/slurm/test_examples_slurm.py)."""


CASES = {
    "diabetes": Example(
        "diabetes",
        "diabetes.toml",
        "diabetes_mlp:build",
        [],
        {"test_r2", "test_rmse", "test_mae", "test_loss"},
        {"predicted_vs_true.png", "residuals.png", "training_curves.png"},
        "test r2",
        {"diabetes_mlp.py", "diabetes_source.py"},
    ),
    "charlm": Example(
        "charlm",
        "charlm.toml",
        "char_transformer:build",
        [
            'preprocess.source_args={"max_files": 8, "context": 32}',
            'train.model_args={"dim": 32, "layers": 1, "heads": 2}',
            "train.epochs=2",
            "train.lr=5e-3",
        ],
        {"test_perplexity", "test_token_accuracy", "test_loss"},
        {"token_accuracy_by_position.png"},
        "test perplexity",
        {"char_transformer.py", "stdlib_text.py"},
    ),
    "charlm_tp": Example(
        "charlm",
        "charlm_tp.toml",
        "transformer",
        [
            'preprocess.source_args={"max_files": 8, "context": 32}',
            'train.model_args={"dim": 32, "layers": 1, "heads": 2}',
            "train.max_steps=60",
            "train.warmup_steps=6",
            "train.lr=5e-3",
        ],
        {"test_perplexity", "test_token_accuracy", "test_loss"},
        {"token_accuracy_by_position.png"},
        "test perplexity",
        {"stdlib_text.py"},
        on_slurm_only=True,
    ),
    "hf_finetune": Example(
        "hf_finetune",
        "finetune.toml",
        "hf",
        ["train.epochs=2"],
        {"test_perplexity", "test_token_accuracy", "test_loss"},
        {"token_accuracy_by_position.png", "huggingface"},
        "test perplexity",
        set(),  # a built-in source and model: no user code to snapshot
    ),
}


_MADE = shutil.ignore_patterns("data", "tokenizer", "base-model")
"""What an example's prepare.py makes: never copied, each test makes its own."""


class Ran(NamedTuple):
    stdout: str
    client: MlflowClient
    parent: Run
    kids: dict[str, Run]
    dataset: Path
    """The dataset folder the run wrote (its manifest's folder)."""
    folder: Path
    """The folder the example ran in (its own, or a prepared copy)."""


def run_example(name: str, tmp_path: Path, extra: list[str]) -> Ran:
    """`trainflow run <the example's experiment file>`, test-sized, in the example's folder."""
    case = CASES[name]
    file = tomllib.loads((EXAMPLES / case.folder / case.experiment).read_text())
    assert file["train"]["model"] == case.model
    folder = EXAMPLES / case.folder
    if (folder / "prepare.py").exists():
        # The example makes its inputs first (as its run.sh does), in a copy of its own: tests
        # on other workers prepare theirs at the same time. A short pretraining: the test
        # needs a base model, not a good one.
        folder = Path(shutil.copytree(folder, tmp_path / case.folder, ignore=_MADE))
        prepare = [sys.executable, "prepare.py", "--steps", "40"]
        made = subprocess.run(prepare, cwd=folder, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr[-3000:]
    argv = [str(Path(sys.executable).with_name("trainflow")), "run", case.experiment]
    for item in [
        f"workdir={tmp_path / 'work'}",
        f"evaluate.registered_model=example-{name}",
        *case.shorter,
        *extra,
    ]:
        argv += ["--set", item]
    out = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert case.headline in out.stdout, out.stdout[-2000:]
    uri = re.search(r"tracking URI\s+(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    parent_id = re.search(r"parent run id\s+(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    kids = {
        r.info.run_name: r
        for r in client.search_runs(
            [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
        )
    }
    (manifest,) = (tmp_path / "work").glob("datasets/*/manifest.json")
    return Ran(out.stdout, client, parent, kids, manifest.parent, folder)


def baselines(name: str, dataset: Path, folder: Path) -> dict[str, float]:
    """The example's own baselines (examples/<name>/<name>_baseline.py) on the splits of the
    dataset the run wrote: charlm's test perplexities, diabetes' test R²s."""
    base = CASES[name].folder  # the folder's project (charlm_tp is charlm's)
    script = folder / f"{base}_baseline.py"
    spec = importlib.util.spec_from_file_location(f"{base}_baseline", script)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found: dict[str, float] = module.baselines(module.splits_from_dataset(dataset))
    return found


def check_example(name: str, ran: Ran) -> None:
    """Metrics, artifacts, the champion, what was learnt, and the user's code snapshot."""
    case, client = CASES[name], ran.client
    evaluate, train = ran.kids["evaluate"], ran.kids["train"]
    assert case.metrics <= set(evaluate.data.metrics), sorted(evaluate.data.metrics)
    logged = {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    assert case.artifacts <= logged, logged
    assert {"train_loss", "val_loss"} <= set(train.data.metrics)
    version = client.get_model_version_by_alias(f"example-{name}", "champion")
    assert version.run_id == evaluate.info.run_id
    test, base = evaluate.data.metrics, baselines(name, ran.dataset, ran.folder)
    if name == "diabetes":  # R² over the same test rows: higher is a smaller squared error
        assert test["test_r2"] > base["train mean"] + 0.3, (test, base)
    elif name == "hf_finetune":  # fine-tuning improved the saved base model
        assert test["test_perplexity"] < 0.9 * base["base model, before fine-tuning"], (test, base)
        assert test["test_perplexity"] < base["unigram token frequencies"], (test, base)
    else:  # the train split's byte frequencies, scored on the same test windows
        assert test["test_perplexity"] < base["unigram byte frequencies"], (test, base)
    if not case.user_files:
        return
    snapshot = ran.parent.data.tags["code_snapshot_hash"]
    assert train.data.tags["code_snapshot_hash"] == snapshot
    code = {a.path.rsplit("/", 1)[-1] for a in _walk(client, ran.parent.info.run_id, "code")}
    assert case.user_files <= code, code


def _walk(client: MlflowClient, run_id: str, path: str) -> list[FileInfo]:
    found: list[FileInfo] = []
    for item in client.list_artifacts(run_id, path):
        found += _walk(client, run_id, item.path) if item.is_dir else [item]
    return found


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if not case.on_slurm_only))
def test_the_example_trains_on_the_local_executor(tmp_path: Path, name: str) -> None:
    check_example(name, run_example(name, tmp_path, []))
