"""Throughput and MFU: the per-rank spread, FLOP counting and the device peaks."""

import pytest
import torch
from torch import nn

from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.throughput import (
    FlopFacts,
    Peak,
    RankClock,
    device_peak,
    epoch_throughput,
    flops_per_sample,
    gpu_peak,
    throughput_metrics,
)


def test_flops_per_sample_counts_forward_and_weight_gradients() -> None:
    # Linear 10 -> 5 without bias: 2*10*5 forward, as much for the weight gradient; the
    # input needs no gradient.
    assert flops_per_sample(nn.Linear(10, 5, bias=False), (10,)) == 200.0


def test_flops_of_a_model_that_cannot_run_on_meta_are_zero() -> None:
    class NeedsData(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.sum())  # reads a value: impossible on the meta device

    assert flops_per_sample(NeedsData(), (3,)) == 0.0


def test_spread_names_the_slowest_rank_and_mfu_uses_all_devices() -> None:
    # Per rank: samples, steps, seconds. Rank 1 takes twice as long.
    figures = [[100.0, 10.0, 1.0], [100.0, 10.0, 2.0], [100.0, 10.0, 1.0]]
    m = throughput_metrics(figures, 50.0, Peak(1000.0, "test"))
    assert (m["rank_samples_per_s_min"], m["rank_samples_per_s_max"]) == (50.0, 100.0)
    assert m["rank_samples_per_s_median"] == 100.0
    assert (m["rank_step_time_s_min"], m["rank_step_time_s_max"]) == (0.1, 0.2)
    assert m["slowest_rank"] == 1.0
    # 300 samples in the slowest rank's 2 s at 50 FLOPs each; 3 devices of 1000 FLOP/s.
    assert m["achieved_flops_per_s"] == 7500.0
    assert m["mfu"] == pytest.approx(7500.0 / 3000.0)


def test_a_tensor_parallel_group_counts_its_samples_once() -> None:
    # 4 ranks in 2 groups of tp=2: each group took 100 samples in 1 s, each rank says so.
    figures = [[100.0, 10.0, 1.0]] * 4
    m = throughput_metrics(figures, 50.0, Peak(1000.0, "test"), tp=2)
    assert m["achieved_flops_per_s"] == 200.0 * 50.0  # 200 samples/s of the whole model
    assert m["mfu"] == pytest.approx(10_000.0 / 4000.0)  # over all 4 ranks' peak


def test_no_mfu_without_a_peak_or_a_flop_count() -> None:
    figures = [[10.0, 1.0, 1.0]]
    assert "mfu" not in throughput_metrics(figures, 5.0, Peak(None, "unknown GPU"))
    counted = throughput_metrics(figures, 0.0, Peak(1.0, "x"))
    assert "achieved_flops_per_s" not in counted and "mfu" not in counted


def test_gpu_table_and_cpu_measurement() -> None:
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16").flops_per_s == 989e12
    assert gpu_peak("NVIDIA H100 PCIe", "fp32").flops_per_s == 51e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp16").flops_per_s == 312e12
    unknown = gpu_peak("Some Future GPU", "bf16")
    assert unknown.flops_per_s is None and "not in trainflow's peak table" in unknown.source
    cpu = device_peak(torch.device("cpu"), "fp32")
    assert cpu.flops_per_s is not None and cpu.flops_per_s > 0
    assert cpu.source.startswith("measured fp32")


def test_one_rank_gathers_its_own_figures() -> None:
    clock = RankClock(torch.device("cpu"))
    clock.stop()
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    m = epoch_throughput(64, 2, 0.5, ctx, FlopFacts(10.0, Peak(None, "none")))
    assert m["rank_samples_per_s_min"] == m["rank_samples_per_s_max"] == 128.0
    assert m["achieved_flops_per_s"] == 1280.0 and "mfu" not in m
    assert clock.seconds > 0
