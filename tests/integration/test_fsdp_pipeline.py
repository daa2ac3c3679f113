"""The whole pipeline on the tiny preset with train.strategy=fsdp on 2 local ranks: sharded
checkpoints while training; evaluation, the logged MLflow model and serving see whole weights,
as after a DDP run."""

from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from trainflow.flows.pipeline import pipeline
from trainflow.tasks.tracking.runs import use_tracking_uri
from trainflow.tasks.train.checkpointing.sharded_checkpoint import SUMS, sharded_checkpoints

pytestmark = pytest.mark.integration


def test_the_tiny_pipeline_trains_under_fsdp_and_logs_a_whole_model(tmp_path: Path) -> None:
    summary = pipeline(preset="tiny", overrides=[f"workdir={tmp_path}", "train.strategy=fsdp"])

    assert summary.test_accuracy > 0.6  # 4 learnable classes: chance is 0.25
    client = MlflowClient(summary.tracking_uri)
    parent = client.get_run(summary.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["train.strategy"] == "fsdp"
    (folder,) = {p.parent.parent for p in tmp_path.rglob(f"checkpoints/*/{SUMS}")}
    shards = [sorted(p.name for p in f.glob("*.distcp")) for f in sharded_checkpoints(folder)]
    assert shards == [["__0_0.distcp", "__1_0.distcp"]] * 2  # 2 epochs, a shard per rank each
    assert summary.model_uri
    with use_tracking_uri(summary.tracking_uri):
        model = mlflow.pytorch.load_model(summary.model_uri)
        pyfunc = mlflow.pyfunc.load_model(summary.model_uri)
    assert pyfunc.metadata.signature is not None
    inputs = pyfunc.metadata.get_input_schema().inputs[0]
    shape = tuple(3 if d == -1 else d for d in inputs.shape)
    example = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(example)).numpy()
    np.testing.assert_allclose(pyfunc.predict(example), expected, rtol=1e-5)
