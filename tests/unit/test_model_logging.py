"""Logging a model leaves no trace of its store in the process's MLflow settings."""

import os
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from tasks.evaluate.model_logging import log_model


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
