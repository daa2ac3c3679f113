"""Tensor parallelism on GPUs: tp=2 over two NCCL ranks (one GPU each) trains the built-in
transformer as one GPU does (tests/unit/test_tensor_parallel.py on CPU ranks). Skipped without
two GPUs. TF32 matmuls on a GPU round more than the CPU's fp32: the bound is 1e-3 relative on
the losses (tests/gpu/test_fsdp_cuda.py's kind of looser bound), not the CPU test's 1e-6."""

from pathlib import Path

import pytest
import torch

from tests.unit.datasets import write_token_dataset
from tests.unit.test_tensor_parallel import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL ranks)"),
]


def test_tp2_over_nccl_trains_as_one_gpu(tmp_path: Path) -> None:
    tokens = write_token_dataset(tmp_path / "ds", context=32, vocab=40, n_train=768, n_val=128)
    one = train(tokens, tmp_path / "one", 1, device="cuda")
    tp = train(tokens, tmp_path / "tp", 2, device="cuda", strategy="fsdp", parallel={"tp": 2})
    for got, want in zip(tp["history"], one["history"], strict=True):
        for key in ("train_loss", "val_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-3), (key, got, want)
