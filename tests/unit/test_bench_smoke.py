"""The benchmark code runs (tiny sizes, CPU): it must not rot between benchmark runs."""

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
