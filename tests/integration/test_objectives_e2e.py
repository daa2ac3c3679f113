"""`trainflow run` on a user's own data through a source plug-in, once per objective beyond
classification: local executor, 2 ranks, a few seconds of training; the metrics land in MLflow,
the evaluate stage's artifacts exist and the model is registered."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.integration

SOURCES = '''
import numpy as np


class Tabular:
    """Regression: 4 features, 2 targets that are linear in them, in 4 row ranges."""

    def parts(self):
        return [(i, i + 150) for i in range(0, 600, 150)]

    def fingerprint(self, part):
        return f"v1 {part}"

    def read(self, part):
        x = np.random.default_rng(part[0]).normal(size=(part[1] - part[0], 4))
        w = np.array([[1.0, -2.0], [0.5, 0.0], [0.0, 1.5], [-1.0, 0.5]])
        return x.astype(np.float32), (x @ w + 3.0).astype(np.float32)


class Cycles:
    """Sequences: windows of 12 ids over cycles of a vocabulary of 7; targets shifted by one."""

    def parts(self):
        return ["a", "b", "c"]

    def fingerprint(self, part):
        return part

    def read(self, part):
        step = {"a": 1, "b": 2, "c": 3}[part]
        ids = (np.arange(1000) * step) % 7
        windows = np.lib.stride_tricks.sliding_window_view(ids, 13)[::5]
        return windows[:, :-1], windows[:, 1:]
'''

CASES = {
    "regression": (
        ["preprocess.source=my_sources:Tabular", "train.model=mlp", "train.lr=0.02"],
        {"test_r2", "test_rmse", "test_mae", "test_loss", "test_r2_1"},
        {"predicted_vs_true.png", "residuals.png", "training_curves.png"},
        "test r2",
    ),
    "sequence": (
        ["preprocess.source=my_sources:Cycles", "train.model=token_conv", "train.lr=0.02"],
        {"test_perplexity", "test_token_accuracy", "test_loss"},
        {"token_accuracy_by_position.png", "token_accuracy_by_position.json"},
        "test perplexity",
    ),
}


@pytest.mark.parametrize("objective", sorted(CASES))
def test_a_users_source_trains_and_evaluates_the_objective(tmp_path: Path, objective: str) -> None:
    overrides, metrics, artifacts, headline = CASES[objective]
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_sources.py").write_text(SOURCES)
    argv = [str(Path(sys.executable).with_name("trainflow")), "run", "--preset", "tiny"]
    for item in [
        f"workdir={tmp_path / 'work'}",
        f"train.objective={objective}",
        "train.epochs=4",
        f"evaluate.registered_model=my-{objective}",
        *overrides,
    ]:
        argv += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(project)}  # where the user's module is found
    out = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert headline in out.stdout, out.stdout[-2000:]
    uri = re.search(r"tracking URI\s+(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    parent = re.search(r"parent run id\s+(\S+)", out.stdout).group(1)  # type: ignore[union-attr]
    client = MlflowClient(uri)
    run = client.get_run(parent)
    kids = {
        r.info.run_name: r
        for r in client.search_runs(
            [run.info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'"
        )
    }
    evaluate, train = kids["evaluate"], kids["train"]
    assert metrics <= set(evaluate.data.metrics), sorted(evaluate.data.metrics)
    logged = {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    assert artifacts <= logged, logged
    assert {"train_loss", "val_loss"} <= set(train.data.metrics)
    version = client.get_model_version_by_alias(f"my-{objective}", "champion")
    assert version.run_id == evaluate.info.run_id
    if objective == "regression":  # learnt: better than predicting the mean
        assert evaluate.data.metrics["test_r2"] > 0.5, evaluate.data.metrics
        assert run.data.metrics["test_r2"] == evaluate.data.metrics["test_r2"]
    else:  # better than a uniform guess over the 7 ids
        assert evaluate.data.metrics["test_perplexity"] < 7, evaluate.data.metrics
