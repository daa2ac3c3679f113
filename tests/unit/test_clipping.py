"""train.max_grad_norm: the global gradient norm across ranks and FSDP shards, clipped.

The rank test runs 2 real gloo ranks (tests.unit.fsdp_ranks) that clip with trainflow's
clip_gradients under DDP and FSDP, against one process holding the whole batch. The norm the
function returns is checked against the test's own norm of the full gradients (gathered from
the shards); the clip against that norm after clipping. fp32 tolerances as test_sharding's:
rounding of reductions in another order, ~1e-7 relative per step. A norm of the local shard
only would be about 1/sqrt(2) of the global one; a sum over ranks of DDP's (already global)
norm twice it: both far outside.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.unit import fsdp_ranks
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

MAX_NORM = 0.25  # the tiny model's first gradient norm is ~0.64: every step clips


def _norms(run: dict[str, list[float]]) -> list[float]:
    """The norm clip_gradients returned at each step (the list holds, second, step 0's norm
    after clipping, measured by the test)."""
    return [run["clip"][0], *run["clip"][2:]]


@pytest.mark.services
def test_fsdp_clips_by_the_same_global_norm_as_ddp_and_one_process(tmp_path: Path) -> None:
    one = fsdp_ranks.single_process("fp32", MAX_NORM)
    unclipped = fsdp_ranks.single_process("fp32")
    runs = [("ddp", "fp32"), ("fsdp", "fp32")]
    results = fsdp_ranks.run_ranks(2, runs, tmp_path / "results.pt", max_norm=MAX_NORM)
    ddp, fsdp = results["ddp-fp32"], results["fsdp-fp32"]
    assert len(_norms(fsdp)) == fsdp_ranks.STEPS
    assert _norms(fsdp) == pytest.approx(_norms(ddp), rel=1e-6)
    assert _norms(ddp) == pytest.approx(_norms(one), rel=1e-5)
    for run in (one, ddp, fsdp):
        assert run["clip"][0] == pytest.approx(run["grad_norm"], rel=1e-6)  # the test's norm
        assert run["clip"][1] == pytest.approx(MAX_NORM, rel=1e-5)  # after clipping
        assert min(_norms(run)) > MAX_NORM
    for name, value in one["weights"].items():
        for run in (ddp, fsdp):
            torch.testing.assert_close(run["weights"][name], value, atol=1e-6, rtol=0)
    moved = sum(float((one["weights"][k] - v).abs().max()) for k, v in unclipped["weights"].items())
    assert moved > 1e-3  # clipping changed the training


def test_the_job_logs_the_epochs_mean_norm_only_when_it_clips(tmp_path: Path) -> None:
    """One rank (submitit's debug executor), the reference CNN: grad_norm in the history with
    train.max_grad_norm set, and no grad_norm without it."""
    dataset = write_dataset(tmp_path / "ds")
    histories = {}
    for clip in (0.0, 0.5):
        cfg = TrainConfig(
            epochs=2,
            batch_size=32,
            device="cpu",
            precision="fp32",
            test_after_training=False,
            max_grad_norm=clip,
        )
        spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / f"run{clip}")
        executor = make_executor(
            ClusterConfig(executor="debug", ranks_per_node=1), tmp_path / f"jobs{clip}"
        )
        ref = wait_for_job(executor.submit(TrainingJob(spec)), lambda line: None)
        assert isinstance(ref, CheckpointRef)
        histories[clip] = json.loads(ref.history_path.read_text())
    assert all("grad_norm" not in h for h in histories[0.0])
    assert all(h["grad_norm"] > 0.0 for h in histories[0.5])
    assert histories[0.5][0]["train_loss"] != histories[0.0][0]["train_loss"]
