"""Throughput and model FLOP utilisation (MFU) of each epoch, per rank and for the job.

Every rank times its own share of an epoch (``RankClock``: from its first batch until its last
step is done on the device, before the epoch's closing all-reduce), and one small all-gather
per epoch brings the figures to rank 0, which logs their min/median/max over ranks: a slow
rank shows as a low minimum. Under DDP every step waits for the slowest rank's gradients, so
step times stay close; what differs is where the time goes (the system metrics per node tell).

The model's FLOPs per sample are counted once, by torch's FLOP counter on a copy of the model
on the meta device (no memory, no compute): one forward and backward of a small batch. MFU is
the achieved FLOP/s over the peak of all ranks' devices: a table of dense bf16/fp16 and fp32
peaks for known GPUs; on a CPU a short measured matmul (``measured_cpu_peak``), since CPUs
have no published peak to look up. A GPU missing from the table gets no MFU, and says why.
"""

import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainflow.compat import fake_forward
from trainflow.console import say
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import tag_run
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.limits.step_times import PARTS, gather_rows
from trainflow.tasks.train.outputs import is_transformers_model, logits_of

# Dense (no sparsity) peak FLOP/s per GPU from the vendors' data sheets: (bf16/fp16 tensor
# cores, fp32 without TF32). The first name that the device name contains wins.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12),
    ("H200", 989e12, 67e12),
    ("GH200", 989e12, 67e12),
    ("B200", 2250e12, 80e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10G", 70e12, 31.2e12),
    ("V100", 125e12, 15.7e12),
)
_CPU_MATMUL_N = 512
_CPU_MATMUL_S = 0.05
"""Long enough: on this 2-core EPYC, one thread, bf16, six measures each gave 209-221 GFLOP/s
over 0.1 s, 214-220 over 0.05 s and 214-217 over 0.3 s; it runs on rank 0 before the first
step, while the other ranks wait, so every job's start paid 0.3 s for it before."""


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s of one rank's device, or None with the reason."""

    flops_per_s: float | None
    """Peak of one device at the training precision; None: unknown (no MFU)."""
    source: str
    """Where the figure comes from, or why there is none (shown on the run)."""


@dataclass(frozen=True)
class FlopFacts:
    """What MFU needs, counted once per job on rank 0 (other ranks hold NO_FLOPS)."""

    per_sample: float
    """Training FLOPs (forward + backward) per sample; 0.0: not counted."""
    peak: Peak
    """One device's peak."""


NO_FLOPS = FlopFacts(0.0, Peak(None, "not counted on this rank"))


def count_flops(
    model: nn.Module,
    sample_shape: tuple[int, ...],
    dtype: str,
    device: torch.device,
    precision: str,
) -> FlopFacts:
    """FLOPs per sample of `model` and the peak of `device` at `precision`."""
    return FlopFacts(flops_per_sample(model, sample_shape, dtype), device_peak(device, precision))


class RankClock:
    """Times one rank's share of an epoch; stop() waits for the device's queued work."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._start = time.perf_counter()
        self.seconds = 0.0

    def stop(self) -> None:
        """Record the seconds since construction, once the device has finished its work."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.seconds = time.perf_counter() - self._start


def flops_per_sample(
    model: nn.Module, sample_shape: tuple[int, ...], dtype: str = "float32", batch: int = 2
) -> float:
    """FLOPs of one training step (forward + backward) per sample, counted on the meta device.

    0.0 when the model cannot run on the meta device (MFU is then left out).
    """
    try:
        meta = copy.deepcopy(model).to("meta")
        x = torch.zeros(batch, *sample_shape, dtype=getattr(torch, dtype), device="meta")
        with FlopCounterMode(display=False) as counter:
            # a transformers model reads its inputs' values: fake tensors (trainflow.compat)
            out = fake_forward(meta, x) if is_transformers_model(meta) else meta(x)
            logits_of(out).float().sum().backward()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0.0
    return counter.get_total_flops() / batch


def device_peak(device: torch.device, precision: str) -> Peak:
    """The table's peak for a GPU, a measured matmul rate for a CPU (see the module doc)."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        rate = measured_cpu_peak(torch.bfloat16 if precision == "bf16" else torch.float32)
        threads = torch.get_num_threads()
        return Peak(rate, f"measured {precision} {_CPU_MATMUL_N}^3 matmul, {threads} thread(s)")
    return Peak(None, f"no MFU: no peak known for {device.type}")


def gpu_peak(name: str, precision: str) -> Peak:
    """The data-sheet peak of the GPU called `name` at `precision` (GPU_PEAKS)."""
    half = precision in ("bf16", "fp16")
    for key, low, full in GPU_PEAKS:
        if key in name:
            return Peak(low if half else full, f"{name} data sheet, {precision} dense")
    return Peak(None, f"no MFU: {name} is not in trainflow's peak table")


def measured_cpu_peak(dtype: torch.dtype) -> float:
    """FLOP/s of square matmuls in `dtype` on this process's threads for ~0.05 s."""
    n = _CPU_MATMUL_N
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # first call allocates and picks kernels
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < _CPU_MATMUL_S:
        torch.mm(a, b)
        calls += 1
    return 2 * n**3 * calls / elapsed


def epoch_throughput(
    samples: int,
    steps: int,
    seconds: float,
    ctx: DistContext,
    facts: FlopFacts,
    parts: list[float] | None = None,
) -> dict[str, float]:
    """Gather every rank's (samples, steps, seconds, and the epoch's seconds of data wait,
    compute and communication: `parts`, tasks.train.limits.step_times) of the epoch (one small
    all-gather) and return, on every rank, the per-rank spread, each rank's step time and its
    parts, achieved FLOP/s and MFU as metrics."""
    row = [float(samples), float(steps), seconds, *(parts or [0.0, 0.0, 0.0])]
    # the ranks of a tensor-parallel group, and the stages of a pipeline, share their samples
    shared = ctx.tp * ctx.pp
    return throughput_metrics(gather_rows(row, ctx), facts.per_sample, facts.peak, shared)


def throughput_metrics(
    figures: list[list[float]], flops: float, peak: Peak, tp: int = 1
) -> dict[str, float]:
    """Metrics from per-rank [samples, steps, seconds, (data_wait, compute, comm seconds)]:
    samples/s and step time per rank as min/median/max, the slowest rank, every rank's step
    time and its parts (`rank_step_s/rank_<r>`, `rank_<part>_s/rank_<r>`: one chart in the
    MLflow UI puts ranks side by side), and (with a FLOP count) achieved FLOP/s and MFU: the
    whole model's FLOPs per sample times the job's samples (each tensor-parallel group of
    `tp` ranks counts its samples once) over every rank's peak."""
    rates = [f[0] / max(f[2], 1e-9) for f in figures]
    step_s = [f[2] / max(f[1], 1) for f in figures]
    metrics = {
        **_spread("rank_samples_per_s", rates),
        **_spread("rank_step_time_s", step_s),
        "slowest_rank": float(rates.index(min(rates))),
    }
    for rank, f in enumerate(figures):
        metrics[f"rank_step_s/rank_{rank}"] = step_s[rank]
        for part, total in zip(PARTS, f[3:], strict=False):
            metrics[f"rank_{part}_s/rank_{rank}"] = total / max(f[1], 1)
    if flops > 0:
        samples = sum(f[0] for f in figures) / tp  # a tp group's ranks share their samples
        total = samples / max(max(f[2] for f in figures), 1e-9)
        metrics["achieved_flops_per_s"] = flops * total
        metrics["model_flops_per_sample"] = flops
        if peak.flops_per_s:
            metrics["mfu"] = flops * total / (peak.flops_per_s * len(figures))
    return metrics


def _spread(name: str, values: list[float]) -> dict[str, float]:
    return {
        f"{name}_min": min(values),
        f"{name}_median": statistics.median(values),
        f"{name}_max": max(values),
    }


def announce_flops(
    model: nn.Module,
    data: DataSpec,
    device: torch.device,
    precision: str,
    journal: Journal | None,
) -> FlopFacts:
    """Count the model's FLOPs per sample and find the device's peak (count_flops), say both in
    the job's log, and record them as tags of the train run (`journal`: rank 0's, if a run)."""
    facts = count_flops(model, data.sample_shape, data.sample_dtype, device, precision)
    say(
        f"model FLOPs per sample {facts.per_sample:.4g} (forward + backward); "
        f"MFU peak: {facts.peak.source}"
    )
    tags = {"mfu_peak": facts.peak.source, "model_flops_per_sample": f"{facts.per_sample:.6g}"}
    tag_run(journal, tags)
    return facts
