"""The logged model on CUDA, and a quiet dask-cuda cluster. Skipped without CUDA."""

import logging
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from tests.unit.test_model_logging import log_reference_cnn
from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.tasks.tracking.runs import use_tracking_uri

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: make gpu)"),
]


def test_logged_model_validates_on_a_gpu_host_and_predicts_on_cuda(tmp_path: Path) -> None:
    # On a CUDA host MLflow validates the input example on the GPU by default: it used to fail
    # ("weights / buffers on 'cpu' device, it can't be loaded on 'cuda'"); log_reference_cnn
    # fails on that warning.
    uri, model_uri, model, example = log_reference_cnn(tmp_path)
    with use_tracking_uri(uri):
        on_cpu = mlflow.pytorch.load_model(model_uri)
        on_cuda = mlflow.pytorch.load_model(model_uri).to("cuda")
        pyfunc = mlflow.pyfunc.load_model(model_uri, model_config={"device": "cpu"})
    x = torch.from_numpy(example)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(on_cpu(x), expected)
        out = on_cuda(x.to("cuda"))
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(pyfunc.predict(example), expected.numpy(), rtol=1e-5)


def test_dask_cuda_cluster_logs_no_info_lines(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("distributed")
    monkeypatch.setattr(logger, "handlers", [])  # as a flow process has it under Prefect
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.DEBUG)
    with dask_client(DaskConfig(backend="gpu")) as (client, backend):
        assert backend == "cupy"
        assert client.submit(lambda: 3).result() == 3
    noisy = [
        r.getMessage()
        for r in caplog.records
        if r.name.split(".")[0] in ("distributed", "dask_cuda") and r.levelno < logging.WARNING
    ]
    assert noisy == []
