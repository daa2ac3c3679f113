"""The benchmark code runs (tiny sizes, CPU): it must not rot between benchmark runs."""

import pytest
import torch

from bench.common import median_seconds, slug, table
from bench.p6_gpu import matmul_peak, model_rate


def test_gpu_benchmark_code_runs_on_cpu_at_tiny_size() -> None:
    cpu = torch.device("cpu")
    assert matmul_peak(cpu, 64, torch.float32, repeats=2) > 0
    rate, flops = model_rate(cpu, width=4, size=16, batch=4, steps=1)
    assert rate > 0 and flops > 0


def test_helpers() -> None:
    assert median_seconds(lambda: None, repeats=3) >= 0
    assert slug("AMD EPYC 9B14 96-Core") == "amd-epyc-9b14-96-core"
    assert "goal" in table("t", [("m", "1", "<= 2")])


def test_lightning_trains_in_the_precision_trainflow_picks() -> None:
    from bench.p7_lightning import PRECISION, lightning_precision
    from trainflow.tasks.train.precision import resolve_precision

    cpu = torch.device("cpu")
    assert lightning_precision(cpu) == PRECISION[resolve_precision("auto", cpu).name]
    assert set(PRECISION.values()) == {"bf16-mixed", "16-mixed", "32-true"}


def test_a_command_is_accounted_with_the_cpu_of_its_children() -> None:
    import os
    import sys

    from bench.first_result import CPUACCT, run_accounted

    busy = (
        "import subprocess, sys; print('begun', flush=True); "
        "subprocess.run([sys.executable, '-c', 'sum(range(3*10**7))']); print('done')"
    )
    out, wall, cpu, begun = run_accounted([sys.executable, "-c", busy], os.environ, mark="begun")
    assert out.returncode == 0 and out.stdout == "begun\ndone\n"
    assert begun is not None and 0 < begun < wall  # the time of the marked line, as it came
    if os.access(CPUACCT, os.W_OK):
        assert cpu is not None and cpu > 0.2  # the grandchild's ~0.5 s of summing counted


def test_a_generic_cpu_name_gets_its_family_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results of two "AMD EPYC" generations (Zen 1 and Zen 3 both without bf16) go to two
    files; a name that carries a model number keeps its file."""
    import bench.common as common
    from trainflow.tasks.train import native_bf16

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(common, "x86_family_model", lambda: "family 25 model 1")
    generic = native_bf16.CpuInfo("AMD EPYC", frozenset())
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: generic)
    assert common.machine_name() == "AMD EPYC family 25 model 1 (no native bf16)"
    named = native_bf16.CpuInfo("AMD EPYC 9254 24-Core Processor", frozenset({"avx512_bf16"}))
    monkeypatch.setattr(native_bf16, "this_cpu", lambda: named)
    assert common.machine_name() == "AMD EPYC 9254 24-Core Processor (native bf16)"
    monkeypatch.undo()  # the real reading, on this machine
    assert common.x86_family_model() == "" or common.x86_family_model().startswith("family ")


def test_the_cpu_report_names_the_cpu_and_times_its_reference() -> None:
    from tests.cpu_report import cpu_name, reference_cpu_s

    assert "family" in cpu_name() or cpu_name() == "unknown CPU"
    assert 0.1 < reference_cpu_s(repeats=1) < 60  # a real `import torch` in a new process
