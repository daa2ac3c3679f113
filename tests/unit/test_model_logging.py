"""Logging a model leaves no trace of its store in the process's MLflow settings; the logged
model loads, predicts and moves to any device."""

import logging
import os
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from trainflow.tasks.evaluate.model_logging import log_model
from trainflow.tasks.spec import image_classification
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model


@pytest.mark.services
@pytest.mark.parametrize("before", [None, "sqlite:///elsewhere.db"])
def test_log_model_restores_the_tracking_uri_and_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str | None
) -> None:
    if before is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", before)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    model = torch.nn.Linear(3, 2)
    model_uri = log_model(model, np.zeros((2, 3), dtype=np.float32), uri, run_id)
    assert model_uri.startswith("models:/")
    assert os.environ.get("MLFLOW_TRACKING_URI") == before
    if before is not None:
        assert mlflow.get_tracking_uri() == before
    else:
        assert mlflow.get_tracking_uri() != uri


class _Records(logging.Handler):
    """Collects the records of a logger that may not propagate (MLflow's own)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def log_reference_cnn(folder: Path) -> tuple[str, str, torch.nn.Module, np.ndarray]:
    """The reference CNN logged as the evaluate stage logs it; (tracking URI, model URI, the
    model, the input example). MLflow's warnings while logging fail the caller's test."""
    uri = f"sqlite:///{folder}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(folder / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    torch.manual_seed(0)
    model = build_model(TrainConfig(), image_classification((1, 28, 28), 10)).eval()
    example = np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32)
    records = _Records()
    logging.getLogger("mlflow").addHandler(records)
    try:
        model_uri = log_model(model, example, uri, run_id)
    finally:
        logging.getLogger("mlflow").removeHandler(records)
    failed = [m for m in records.messages if "Failed to validate serving input" in m]
    assert failed == [], failed
    return uri, model_uri, model, example


@pytest.mark.services
def test_logged_model_loads_predicts_and_moves_to_any_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_DEFAULT_PREDICTION_DEVICE", raising=False)
    uri, model_uri, model, example = log_reference_cnn(tmp_path)
    assert "MLFLOW_DEFAULT_PREDICTION_DEVICE" not in os.environ  # scoped to the logging
    with use_tracking_uri(uri):
        loaded = mlflow.pytorch.load_model(model_uri)
        pyfunc = mlflow.pyfunc.load_model(model_uri)
    x = torch.from_numpy(example)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(loaded(x), expected)
        np.testing.assert_allclose(pyfunc.predict(example), expected.numpy(), rtol=1e-5)
        # Device-portable: no tensor or graph node is tied to the export's device, so the
        # module follows .to() wholesale (meta here; cuda in tests/gpu/test_model_cuda.py).
        moved = loaded.to("meta")
        assert {t.device.type for t in moved.state_dict(keep_vars=True).values()} == {"meta"}
        assert [n for n in moved.graph.nodes if "device" in n.kwargs] == []
        assert moved(x.to("meta")).shape == (4, 10)
