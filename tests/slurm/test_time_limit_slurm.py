"""Time limits on the real Slurm: a job whose training needs several times its 1-minute limit
checkpoints before each limit, is requeued more often than cluster.max_requeues allows for
attempts without progress, and ends with exactly the weights and metrics of a run without a
limit; inside a job, and inside each element of a job array, squeue says how long it has
left.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.slow_steps import SlowSteps
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import JobError
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint, load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

_TIMED = {"samples_per_s", "epoch_time_s", "achieved_flops_per_s", "mfu", "slowest_rank"}


def _untimed(entry: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in entry.items() if k not in _TIMED and not k.startswith("rank_")}


def test_a_job_reads_its_time_left_from_squeue(tmp_path: Path) -> None:
    code = "from trainflow.tasks.train.limits.time_limit import seconds_left; print(seconds_left())"
    out = subprocess.run(
        ["srun", "--time=1", "--chdir", str(tmp_path), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    left = float(out.strip().splitlines()[-1])
    assert 30 < left <= 60  # a 1-minute limit, read within the job's first seconds


def test_each_element_of_a_job_array_reads_its_own_time_left(tmp_path: Path) -> None:
    # One element runs under the array's own job id, which names every element in squeue;
    # both elements are in the queue when they read (the sleep), so that id lists two.
    code = (
        "import time; time.sleep(5); "
        "from trainflow.tasks.train.limits.time_limit import seconds_left; print(seconds_left())"
    )
    subprocess.run(
        ["sbatch", "--wait", "--array=0-1", "--time=1", "--chdir", str(tmp_path),
         "--output", str(tmp_path / "%a.out"), "--wrap", f"{sys.executable} -c '{code}'"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    for element in (0, 1):
        out = (tmp_path / f"{element}.out").read_text()
        left = float(out.strip().splitlines()[-1])
        assert 30 < left <= 60, out  # a 1-minute limit, read within the element's first seconds


@pytest.mark.timeout(900)
def test_a_job_needing_several_time_limits_ends_as_one_without(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "data", n_train=8192, n_val=256)
    train = TrainConfig(
        epochs=4,
        batch_size=64,
        precision="fp32",
        model="resnet",
        width=16,
        time_limit_margin_s=5,
    )
    spec = TrainJobSpec(
        train=train, dataset=dataset, out_dir=tmp_path / "slurm", signal_delay_s=20, max_requeues=0
    )
    slurm = ClusterConfig(
        executor="slurm", nodes=2, ranks_per_node=1, timeout_min=1, signal_delay_s=20
    )
    lines: list[str] = []
    # 256 steps of at least 0.2 s each: more than one attempt's time on a fast machine too.
    job = make_executor(slurm, tmp_path / "jobs-slurm").submit(SlowSteps(spec, 0.2))
    assert isinstance(wait_for_job(job, lines.append), CheckpointRef)
    resumed = [ln for ln in lines if " continues from step " in ln]
    assert len(resumed) > spec.max_requeues, "\n".join(lines)  # progress never counts
    assert any("time limit in " in ln and "checkpointing at step" in ln for ln in lines)

    # The same job on the same nodes, with a limit it never reaches.
    plain = spec.model_copy(update={"out_dir": tmp_path / "plain"})
    unlimited = make_executor(slurm.model_copy(update={"timeout_min": 30}), tmp_path / "jobs")
    assert isinstance(wait_for_job(unlimited.submit(TrainingJob(plain)), print), CheckpointRef)

    got = load_state(latest_checkpoint(spec.out_dir / "checkpoints"))  # type: ignore[arg-type]
    want = load_state(latest_checkpoint(plain.out_dir / "checkpoints"))  # type: ignore[arg-type]
    assert (got["epoch"], got["step"]) == (want["epoch"], want["step"])
    for name, tensor in want["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=1e-6, msg=name)
    for a, b in zip(got["history"], want["history"], strict=True):
        assert _untimed(a) == pytest.approx(_untimed(b), abs=1e-6)


@pytest.mark.timeout(600)
def test_attempts_without_progress_fail_after_max_requeues(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "data")
    # A margin longer than the limit: every attempt stops before its first step.
    train = TrainConfig(epochs=2, batch_size=64, precision="fp32", time_limit_margin_s=3600)
    spec = TrainJobSpec(
        train=train, dataset=dataset, out_dir=tmp_path / "run", signal_delay_s=20, max_requeues=1
    )
    slurm = ClusterConfig(
        executor="slurm", nodes=2, ranks_per_node=1, timeout_min=1, signal_delay_s=20
    )
    lines: list[str] = []
    job = make_executor(slurm, tmp_path / "jobs").submit(TrainingJob(spec))
    with pytest.raises(JobError) as failed:
        wait_for_job(job, lines.append)
    assert "2 attempts in a row reached their time limit without a new checkpoint" in str(
        failed.value
    )
    assert "cluster.max_requeues=1" in str(failed.value)
    assert sum("attempt 2 continues from step 0" in ln for ln in lines) == 1
