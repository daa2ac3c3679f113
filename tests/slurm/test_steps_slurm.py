"""A run counted in optimizer steps on the dev Slurm: stopped at train.max_steps inside an
epoch, then extended, it ends bit for bit where a run straight to the new end does (2 nodes,
one rank each, DDP, clipping on; tests/unit/test_steps.py runs the same locally, DDP and
FSDP)."""

from pathlib import Path

import pytest
import torch

from tests.unit.datasets import write_dataset
from tests.unit.test_steps import _final, _spec, _tensors
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.train.job import TrainingJob
from trainflow.tasks.train.ref import CheckpointRef


@pytest.mark.timeout(600)
def test_a_run_stopped_at_max_steps_and_extended_on_slurm_equals_a_straight_run(
    tmp_path: Path,
) -> None:
    dataset = write_dataset(tmp_path / "ds")  # 256 samples: 4 steps an epoch on 2 ranks
    slurm = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=1, timeout_min=10)
    run = make_executor(slurm, tmp_path / "jobs").submit
    straight = _spec(dataset, tmp_path / "straight", "ddp", max_steps=12)
    assert isinstance(wait_for_job(run(TrainingJob(straight)), print), CheckpointRef)
    first = _spec(dataset, tmp_path / "extended", "ddp", max_steps=6, checkpoint_every_steps=5)
    assert isinstance(wait_for_job(run(TrainingJob(first)), print), CheckpointRef)
    assert (_final(first.out_dir, False)["step"], _final(first.out_dir, False)["epoch"]) == (6, 1)
    extended = first.model_copy(update={"train": first.train.model_copy(update={"max_steps": 12})})
    assert isinstance(wait_for_job(run(TrainingJob(extended)), print), CheckpointRef)
    want, got = _final(straight.out_dir, False), _final(extended.out_dir, False)
    assert got["step"] == want["step"] == 12
    for part in ("model", "optimizer"):
        expected, resumed = _tensors(want[part]), _tensors(got[part])
        assert expected.keys() == resumed.keys() and expected
        for name, tensor in expected.items():
            assert torch.equal(resumed[name], tensor), f"{part}{name} differs"
