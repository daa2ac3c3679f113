"""train.strategy=fsdp on GPUs: NCCL ranks on a CUDA mesh against one process (two GPUs or
more), and the job's sharded checkpoints of CUDA tensors on one GPU. Skipped without CUDA."""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit import fsdp_ranks
from tests.unit.datasets import write_dataset
from trainflow.tasks.train.checkpointing.sharded_checkpoint import sharded_checkpoints
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run: make gpu)"),
]


def _single_on_cuda(precision: str) -> dict[str, Any]:
    model = fsdp_ranks.tiny_model().cuda()
    policy = fsdp_ranks.policy_for(precision, "cuda")
    losses, norm, _, _ = fsdp_ranks.train(model, policy, 0, 1, "cuda")
    return {"losses": losses, "grad_norm": norm}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL ranks)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_over_nccl_averages_gradients_like_one_gpu(precision: str, tmp_path: Path) -> None:
    results = fsdp_ranks.run_ranks(2, [("fsdp", precision)], tmp_path / "r.pt", "cuda")
    run, ref = results[f"fsdp-{precision}"], _single_on_cuda(precision)
    # TF32 and bf16 matmuls on the GPU: looser than the CPU's fp32 tolerances, still far
    # from the 2x gradient norm a summing reduction would give.
    assert run["grad_norm"] / ref["grad_norm"] == pytest.approx(1.0, abs=1e-2)
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-2)
    for rank in run["local"]:
        assert rank["params"] <= rank["full_params"] / 2 * 1.05


def test_an_fsdp_job_on_one_gpu_saves_sharded_and_resumes(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "data")
    cfg = TrainConfig(model="mlp", strategy="fsdp", epochs=2, batch_size=32, device="cuda")
    first = TrainingJob(TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run"))()
    assert first is not None
    assert [f.name for f in sharded_checkpoints(tmp_path / "run" / "checkpoints")] == [
        "epoch-000002",
        "epoch-000001",
    ]
    more = cfg.model_copy(update={"epochs": 3})
    again = TrainingJob(TrainJobSpec(train=more, dataset=dataset, out_dir=tmp_path / "run"))()
    assert again is not None and again.epoch >= 1
    best = torch.load(again.path, weights_only=True)
    assert all(t.device.type == "cpu" for t in best["model"].values())
