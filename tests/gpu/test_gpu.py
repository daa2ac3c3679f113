"""GPU path: dask-cuda + CuPy preprocessing, NCCL DDP, bf16/fp16 autocast. Skipped without CUDA."""

from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.config import ClusterConfig, DaskConfig
from cluster.dask import dask_client
from cluster.executor import make_executor
from cluster.jobs import wait_for_job
from tasks.preprocess.config import PreprocessConfig
from tasks.preprocess.dataset import load_split
from tasks.preprocess.run import run_preprocess
from tasks.train.config import TrainConfig
from tasks.train.job import TrainingJob, TrainJobSpec
from tasks.train.models import build_model
from tasks.train.precision import resolve_precision
from tasks.train.ref import CheckpointRef

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: make gpu)"),
]

_DATA = PreprocessConfig(source="synthetic", synthetic_samples=512, shard_size=128)


def test_dask_cuda_cluster_preprocesses_with_cupy(tmp_path: Path) -> None:
    with dask_client(DaskConfig(backend="gpu")) as (client, backend):
        assert backend == "cupy"
        ref = run_preprocess(_DATA, tmp_path, client, backend, "gpu-test")
    x, _ = load_split(ref.path, "train", verify=True)
    # Normalised with the train statistics: mean ~0, std ~1 per channel.
    assert np.allclose(x.mean(axis=(0, 2, 3)), 0.0, atol=1e-3)
    assert np.allclose(x.std(axis=(0, 2, 3)), 1.0, atol=1e-2)


@pytest.mark.parametrize("precision", ["auto", "fp16", "bf16", "fp32"])
def test_precision_policies_train_a_step_on_cuda(precision: str) -> None:
    device = torch.device("cuda", 0)
    policy = resolve_precision(precision, device)
    if precision == "auto":
        expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        assert policy.name == expected
    model = build_model(TrainConfig(), (1, 16, 16), 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = policy.make_scaler()
    x = torch.randn(8, 1, 16, 16, device=device)
    y = torch.randint(0, 4, (8,), device=device)
    with policy.autocast():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(loss)


def test_training_job_uses_nccl_on_gpus(tmp_path: Path) -> None:
    gpus = min(torch.cuda.device_count(), 2)
    with dask_client(DaskConfig(backend="cpu")) as (client, backend):
        ref = run_preprocess(_DATA, tmp_path / "data", client, backend, "gpu-job")
    spec = TrainJobSpec(train=TrainConfig(epochs=2), dataset=ref, out_dir=tmp_path / "run")
    cluster = ClusterConfig(ranks_per_node=gpus, gpus_per_node=gpus)
    job = make_executor(cluster, tmp_path / "jobs").submit(TrainingJob(spec))
    lines: list[str] = []
    ckpt = wait_for_job(job, lines.append)
    assert isinstance(ckpt, CheckpointRef)
    start = [line for line in lines if "training reference_cnn" in line]
    assert start and "device cuda" in start[0], lines
    if gpus > 1:  # one rank needs no process group
        assert "backend nccl" in start[0]
