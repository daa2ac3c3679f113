"""A rank that hangs on the dev cluster's second node is named with its node, phase and frame,
and the job restarts from its checkpoint (each rank's guard runs in its Slurm task)."""

import json
from pathlib import Path
from typing import Any

import pytest
import submitit

from tests.hanging import HangingJob
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.restarts import run_with_restarts
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("strategy,model", [("ddp", "reference_cnn"), ("fsdp", "mlp")])
def test_a_rank_hung_on_the_second_node_is_named_and_the_job_restarts(
    tmp_path: Path, strategy: str, model: str
) -> None:
    train = TrainConfig(
        epochs=5,
        batch_size=32,
        device="cpu",
        precision="fp32",
        hang_timeout_s=5,
        strategy=strategy,
        model=model,
    )
    spec = TrainJobSpec(train=train, dataset=write_dataset(tmp_path / "ds"), out_dir=tmp_path / "o")
    # 2 ranks of 4 steps an epoch: forward 10 is in epoch 3.
    job = HangingJob(spec, rank=1, at_step=10, marker=tmp_path / "m")
    cfg = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=1, timeout_min=10)
    submitted: list[submitit.Job[Any]] = []

    def submit(exclude: list[str], nodes: int) -> submitit.Job[Any]:
        submitted.append(make_executor(cfg, tmp_path / "j").submit(job))
        return submitted[-1]

    log: list[str] = []
    ref = run_with_restarts(cfg, submit, lambda j: wait_for_job(j, lambda line: None), log.append)
    assert len(submitted) == 2 and isinstance(ref, CheckpointRef)
    first = submitted[0]
    ended = json.loads((first.paths.folder / f"{first.job_id}_1_exit.json").read_text())
    assert ended["slurm_node"] == "tfnode2" and ended["hung"]["phase"] == "step"
    assert ended["hung"]["frame"].endswith(" in never_returns")
    assert log[0].startswith(
        f"job {first.job_id} lost rank 1 (node tfnode2): rank 1 on node tfnode2 hung in phase "
        "step for "
    ), log
    assert "stacks of the hung rank" in first.task(1).paths.stderr.read_text()
