"""A time limit under a device mesh, for real: the built-in transformer split over 2 gloo ranks
(tp=2), each step at least FLOOR_S long, under a LIMIT_S limit of submitit's local executor.
The job checkpoints its shards at a step boundary before each limit (every rank of the mesh
stops at the step rank 0's watch broadcasts), requeues, resumes on the same mesh, and ends with
the weights, optimizer state and history of the run without a limit, bit for bit.

The machinery (executor, slow steps, the end's comparison) is test_time_limit(_fsdp).py's."""

from pathlib import Path

import pytest

from tests.slow_steps import SlowSteps
from tests.unit.datasets import write_token_dataset
from tests.unit.test_time_limit import _executor
from tests.unit.test_time_limit_fsdp import _assert_same_end, _final, _kept, _steps
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

LIMIT_S, FLOOR_S = 40.0, 0.5
"""One epoch of 64 steps of at least 0.5 s (32 s) outlasts what an attempt of 40 s has left
after its start-up (5 to 15 s), the margin (5 s), the save it reserves (7.5 s before one is
measured) and the signal's delay (2 s): 2 attempts on an idle machine, 4 at most on a loaded
one (of the local executor's 6)."""


def _spec(out: Path) -> TrainJobSpec:
    tokens = write_token_dataset(out / "ds", context=32, vocab=40, n_train=1024, n_val=64)
    cfg = TrainConfig(
        model="transformer",
        model_args={"dim": 64, "layers": 2, "heads": 4},
        objective="sequence",
        strategy="fsdp",
        parallel={"tp": 2},
        device="cpu",
        precision="fp32",
        epochs=1,
        batch_size=16,
        time_limit_margin_s=5.0,
        test_after_training=False,
    )
    return TrainJobSpec(train=cfg, dataset=tokens, out_dir=out / "run", max_requeues=0)


@pytest.mark.services
@pytest.mark.timeout(600)
def test_a_mesh_job_longer_than_its_time_limit_ends_as_one_without(tmp_path: Path) -> None:
    plain = _spec(tmp_path / "plain")
    job = _executor(tmp_path / "plain" / "jobs", None).submit(TrainingJob(plain))
    assert isinstance(wait_for_job(job, lambda line: None), CheckpointRef)
    lines: list[str] = []
    limited = _spec(tmp_path / "limited")
    job = _executor(tmp_path / "limited" / "jobs", LIMIT_S).submit(SlowSteps(limited, FLOOR_S))
    assert isinstance(wait_for_job(job, _kept(lines)), CheckpointRef)
    stops = [ln for ln in lines if "checkpointing at step" in ln]
    resumed = [ln for ln in lines if " continues from step " in ln]
    assert len(resumed) >= 1 and len(stops) == len(resumed), "\n".join(lines)
    assert _steps(stops, "checkpointing at step ") == _steps(resumed, "continues from step ")
    _assert_same_end(_final(limited.out_dir), _final(plain.out_dir))
