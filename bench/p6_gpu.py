"""P6 (GPU only): model FLOP/s over a bf16 matmul peak measured in the same run (goal >= 30%
on an H100).

The model is the residual net at a size that fills the GPU (width 128, 3x64x64 inputs,
batch 256), trained with bf16 autocast and channels_last; its FLOPs per step are counted by
torch's FlopCounterMode on one forward + backward. The peak is the median rate of large bf16
matmuls on the same device.
"""

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """Median FLOP/s of n x n matmuls in dtype on device."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def model_rate(
    device: torch.device, width: int, size: int, batch: int, steps: int = 10
) -> tuple[float, float]:
    """(FLOP/s, FLOPs per step) of bf16-autocast training steps of the residual net."""
    model = build_model(
        TrainConfig(model="resnet", width=width), image_classification((3, size, size), 10)
    ).to(device)
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # stubs lack it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = float(counter.get_total_flops())
    for _ in range(3):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return flops * steps / (time.perf_counter() - start), flops


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """MFU of the residual net on the GPU; skipped (and said so) without one."""
    title = "P6 GPU model FLOP/s vs bf16 matmul peak"
    if not torch.cuda.is_available():
        return title, [("model / peak", "skipped", "no CUDA GPU here")], {"skipped": "no GPU"}
    device = torch.device("cuda", 0)
    peak = matmul_peak(device, 8192, torch.bfloat16)
    rate, flops = model_rate(device, width=128, size=64, batch=256)
    result = {
        "peak_flops": peak,
        "model_flops": rate,
        "flops_per_step": flops,
        "ratio": rate / peak,
        "device": torch.cuda.get_device_name(0),
    }
    rows = [
        ("model / peak", f"{rate / peak:.1%}", ">= 30% (H100)"),
        ("  model TFLOP/s / peak TFLOP/s", f"{rate / 1e12:.0f}/{peak / 1e12:.0f}", ""),
    ]
    return title, rows, result
