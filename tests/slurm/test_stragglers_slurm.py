"""A rank slowed on purpose on the dev cluster's second node is named with that node and the
slow part, in rank 0's forwarded log (each rank a Slurm task on its own node)."""

from pathlib import Path

import pytest

from tests.slow_rank import SlowRankJob
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec

pytestmark = pytest.mark.timeout(300)


def test_a_rank_slow_in_its_data_path_on_the_second_node_is_named(tmp_path: Path) -> None:
    train = TrainConfig(
        epochs=4,
        batch_size=32,
        device="cpu",
        precision="fp32",
        straggler_window_steps=2,
        straggler_windows=3,
    )
    spec = TrainJobSpec(train=train, dataset=write_dataset(tmp_path / "ds"), out_dir=tmp_path / "o")
    # 2 ranks of 4 steps an epoch: named at the end of the third window, step 6.
    job = SlowRankJob(spec, rank=1, where="data", delay_s=0.05)
    cfg = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=1, timeout_min=10)
    lines: list[str] = []
    wait_for_job(make_executor(cfg, tmp_path / "j").submit(job), lines.append)
    warnings = [line for line in lines if "warning: straggler" in line]
    assert len(warnings) == 1, lines
    assert warnings[0].startswith(
        "[rank0@tfnode1] warning: straggler rank 1 on node tfnode2: data wait "
    ), warnings
    assert warnings[0].endswith("over the last 6 steps (to step 6)"), warnings
