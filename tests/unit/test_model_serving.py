"""The logged model serves without trainflow: for each objective's kind of model, it loads in a
fresh Python whose path holds the environment's packages but neither trainflow nor the user's
project, and predicts what the trained model predicts."""

import site
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from trainflow.tasks.evaluate.model_logging import log_model
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model

# -S: no site hooks, so no editable-install finder maps `trainflow` to the repo; only the
# environment's site-packages is put on the path (trainflow is not in it: editable install).
# One process serves every model (each argument after the URI: model URI, input, output).
SERVE = """
import importlib.util, sys
sys.path.append(sys.argv[1])
for name in ("trainflow", "tasks", "flows", "cluster"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable"
import mlflow, mlflow.pytorch, numpy, torch
mlflow.set_tracking_uri(sys.argv[2])
for model_uri, x, y in zip(*[iter(sys.argv[3:])] * 3):
    model = mlflow.pytorch.load_model(model_uri)
    with torch.no_grad():
        numpy.save(y, model(torch.from_numpy(numpy.load(x))).numpy())
assert not [m for m in sys.modules if m.startswith("trainflow")]
"""

CASES = {
    "classification": (
        TrainConfig(model="reference_cnn"),
        DataSpec((1, 12, 12), "float32", "classification", 3, ()),
    ),
    "regression": (
        TrainConfig(model="mlp", width=8),
        DataSpec((5,), "float32", "regression", None, (2,), "float32"),
    ),
    "sequence": (
        TrainConfig(model="token_conv", width=8),
        DataSpec((6,), "int64", "sequence", 9, (6,), "int64"),
    ),
}


def _inputs(spec: DataSpec, rows: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if spec.sample_dtype == "int64":
        return rng.integers(0, int(spec.num_classes or 2), size=(rows, *spec.sample_shape))
    return rng.random((rows, *spec.sample_shape), dtype=np.float32)


@pytest.mark.services
def test_the_logged_models_predict_the_same_in_a_python_without_trainflow(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    argv = [sys.executable, "-S", "-E", "-s", "-c", SERVE, site.getsitepackages()[0], uri]
    expected = {}
    for objective, (cfg, spec) in CASES.items():
        torch.manual_seed(0)
        model = build_model(cfg, spec).eval()
        run_id = client.create_run(exp).info.run_id
        model_uri = log_model(model, _inputs(spec, 4), uri, run_id)
        x = _inputs(spec, 7)  # another batch size than the example's
        np.save(tmp_path / f"{objective}.x.npy", x)
        argv += [model_uri, str(tmp_path / f"{objective}.x.npy"), str(tmp_path / objective)]
        with torch.no_grad():
            expected[objective] = model(torch.from_numpy(x)).numpy()
    out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for objective, (_cfg, spec) in CASES.items():
        served = np.load(tmp_path / f"{objective}.npy")
        assert served.shape == spec.output_shape(7), objective
        np.testing.assert_allclose(served, expected[objective], rtol=1e-5, atol=1e-6)
