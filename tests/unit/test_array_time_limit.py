"""A job array's elements (a sweep's) under the local executor's time limit: each runs to its
end across the limits it meets, its requeues with progress not counted against
cluster.max_requeues (0 here), and ends with exactly the weights and metrics of an element
trained without a limit."""

import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

from tests.slow_steps import SlowSteps
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.jobs import wait_for_jobs
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint, load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.task import submit_array

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LRS = (1e-3, 3e-3)
"""The grid: one element per learning rate."""


def _specs(dataset_root: Path, out: Path) -> list[TrainJobSpec]:
    dataset = write_dataset(dataset_root, n_train=6144, n_val=128)
    specs = []
    for i, lr in enumerate(LRS):
        train = TrainConfig(
            epochs=2,
            batch_size=64,
            lr=lr,
            precision="fp32",
            device="cpu",
            model="resnet",
            width=16,
            time_limit_margin_s=5.0,
        )
        specs.append(
            TrainJobSpec(train=train, dataset=dataset, out_dir=out / f"element-{i}", max_requeues=0)
        )
    return specs


def _final(spec: TrainJobSpec) -> dict[str, Any]:
    path = latest_checkpoint(spec.out_dir / "checkpoints")
    assert path is not None, spec.out_dir
    return load_state(path)


def _untimed(entry: dict[str, float]) -> dict[str, float]:
    timed = {"samples_per_s", "epoch_time_s", "achieved_flops_per_s", "mfu", "slowest_rank"}
    return {k: v for k, v in entry.items() if k not in timed and not k.startswith("rank_")}


@pytest.mark.services
@pytest.mark.timeout(600)
def test_array_elements_run_to_their_end_across_time_limits(tmp_path: Path) -> None:
    specs = _specs(tmp_path / "ds", tmp_path / "limited")
    plain = [s.model_copy(update={"out_dir": tmp_path / "plain" / s.out_dir.name}) for s in specs]
    # 96 steps an epoch of at least 0.3 s each: an element outlasts the 1-minute limit.
    one_minute = ClusterConfig(ranks_per_node=1, timeout_min=1, max_requeues=0)
    limited = submit_array(specs, one_minute, tmp_path / "jobs", lambda s: SlowSteps(s, 0.3))
    unlimited = submit_array(plain, ClusterConfig(ranks_per_node=1), tmp_path / "jobs-plain")
    lines: list[str] = []
    outcomes = wait_for_jobs(limited + unlimited, lines.append)
    assert all(isinstance(o, CheckpointRef) for o in outcomes), outcomes
    for job in limited:
        # More requeues than max_requeues (0): those that made progress do not count.
        log = job.stdout() or ""
        assert "checkpointing at step" in log, log[-3000:]
        assert "attempt 2 continues from step" in log, log[-3000:]
    for spec, ref in zip(specs, plain, strict=True):
        got, want = _final(spec), _final(ref)
        assert (got["epoch"], got["step"]) == (want["epoch"], want["step"]) == (2, 192)
        for name, tensor in want["model"].items():
            torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=0, msg=name)
        for a, b in zip(got["history"], want["history"], strict=True):
            assert _untimed(a) == _untimed(b)
