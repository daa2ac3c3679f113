"""GPU path: dask-cuda + CuPy preprocessing, NCCL DDP, bf16/fp16 autocast, pinned-memory
prefetch, CUDA graphs. Skipped without CUDA."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig, DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import load_split
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, rank_batches
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.precision import resolve_precision
from trainflow.tasks.train.ref import CheckpointRef

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
    model = build_model(TrainConfig(), image_classification((1, 16, 16), 4)).to(device)
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


def test_prefetched_host_batches_reach_the_gpu_intact_while_it_is_busy() -> None:
    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 8, 8, generator=gen).contiguous(memory_format=torch.channels_last)
    split = Split(x, torch.randint(0, 10, (300,), generator=gen))
    indices = rank_batches(split, 32, seed=0, epoch=1, rank=0, world_size=1)
    sums, labels = [], []
    for bx, by in split.batches(indices, device):
        assert bx.device == device and bx.is_contiguous(memory_format=torch.channels_last)
        # Keep the compute stream behind the copies: a batch read before its copy landed,
        # or whose memory the next copies reused too early, would give wrong sums.
        torch.cuda._sleep(2_000_000)
        sums.append(bx.sum(dim=(1, 2, 3)))
        labels.append(by * 1)
    torch.cuda.synchronize()
    for got, got_y, index in zip(sums, labels, indices, strict=True):
        torch.testing.assert_close(got.cpu(), x[index].sum(dim=(1, 2, 3)))
        assert torch.equal(got_y.cpu(), split.y[index])
    (prefetcher,) = split._prefetchers.values()
    assert all(slot.x.is_pinned() and slot.y.is_pinned() for slot in prefetcher._slots)


def _train(
    dataset: DatasetRef, out: Path, epochs: int, **train: object
) -> tuple[CheckpointRef, list[dict[str, float]]]:
    cfg = TrainConfig(epochs=epochs, batch_size=32, device="cuda", **train)
    ref = TrainingJob(TrainJobSpec(train=cfg, dataset=dataset, out_dir=out))()
    assert isinstance(ref, CheckpointRef)
    return ref, json.loads(ref.history_path.read_text())


def test_a_host_placed_split_trains_through_the_prefetcher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=256, n_val=64)
    ref, history = _train(dataset, tmp_path / "run", 4, data_placement="host")
    assert "data in pinned-prefetch host memory" in capsys.readouterr().out
    assert [h["step"] for h in history] == [8, 16, 24, 32]
    assert ref.metrics["val_accuracy"] > 0.5  # chance is 0.25


@pytest.mark.parametrize("placement", ["device", "host"])
def test_cuda_graphs_train_and_resume_without_skipped_graphs(
    placement: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    counters.clear()
    dataset = write_dataset(tmp_path / "ds", n_train=250, n_val=64)
    settings = {"cuda_graphs": True, "data_placement": placement}
    _train(dataset, tmp_path / "run", 1, **settings)
    ref, history = _train(dataset, tmp_path / "run", 3, **settings)  # resumes after epoch 1
    out = capsys.readouterr().out
    assert "cuda_graphs on" in out and "resuming from" in out
    assert [h["step"] for h in history] == [7, 14, 21]  # 250 // 32: the partial batch dropped
    assert ref.metrics["val_accuracy"] > 0.5
    assert cudagraph_trees.get_manager(0, create_if_none_exists=False) is not None
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP needs 2 GPUs")
def test_cuda_graphs_train_with_ddp_on_nccl(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds", n_train=256, n_val=64)
    cfg = TrainConfig(epochs=2, batch_size=32, cuda_graphs=True, ddp_bucket_cap_mb=1)
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run")
    cluster = ClusterConfig(ranks_per_node=2, gpus_per_node=2)
    job = make_executor(cluster, tmp_path / "jobs").submit(TrainingJob(spec))
    lines: list[str] = []
    ckpt = wait_for_job(job, lines.append)
    assert isinstance(ckpt, CheckpointRef) and ckpt.metrics["val_accuracy"] > 0.5
    start = [line for line in lines if "training reference_cnn" in line]
    assert start and "backend nccl" in start[0] and "cuda_graphs on" in start[0], lines
