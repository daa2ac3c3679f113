"""A run resumed on fewer ranks keeps its global batch (tasks.train.resume): the same samples
in every optimizer step, as many steps, the same weights as the run that never stopped.

Real rank processes: 2 gloo ranks through submitit's local executor write the checkpoint of
epoch 1 and die in epoch 2; one rank (this process) resumes and finishes epoch 2.
"""

import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import JobError, wait_for_job
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.relay import relaying
from trainflow.tasks.train.cadence import Due
from trainflow.tasks.train.checkpointing.checkpoint import Resumable
from trainflow.tasks.train.checkpointing.sharded_checkpoint import TRAIN_STATE, sharded_checkpoints
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, accumulated_batches, rank_batches
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.recipe import Recipe
from trainflow.tasks.train.resume import global_batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _LosesANodeInEpoch2(Recipe):
    def segment(self) -> tuple[dict[str, float], Due]:
        if self.progress.epoch >= 1:
            raise RuntimeError("simulated loss of a node")
        return super().segment()


class StopsInEpoch2(TrainingJob):
    """Dies as a lost rank's job does: after epoch 1 was checkpointed, before epoch 2 ends."""

    recipe = _LosesANodeInEpoch2


def _spec(dataset: DatasetRef, out_dir: Path, strategy: str) -> TrainJobSpec:
    train = TrainConfig(
        model="mlp",
        strategy=strategy,
        epochs=2,
        batch_size=32,
        precision="fp32",
        device="cpu",
        seed=3,
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out_dir)


def _final(out_dir: Path, sharded: bool) -> dict[str, Any]:
    """The newest checkpoint's whole state: progress, model and optimizer."""
    if not sharded:
        newest = sorted((out_dir / "checkpoints").glob("epoch-*.pt"))[-1]
        state: dict[str, Any] = torch.load(newest, weights_only=True)
        return state
    folder = sharded_checkpoints(out_dir / "checkpoints")[0]
    state = torch.load(folder / TRAIN_STATE, weights_only=True)
    dcp_to_torch_save(folder, out_dir / "whole.pt")
    return {**state, **torch.load(out_dir / "whole.pt", weights_only=False)}


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        if isinstance(value, dict | list | tuple | torch.Tensor):
            found |= _tensors(value, f"{prefix}.{key}")
    return found


@pytest.mark.services
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_run_resumed_on_half_the_ranks_takes_the_same_steps_to_the_same_weights(
    tmp_path: Path, strategy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_dataset(tmp_path / "ds")
    sharded = strategy == "fsdp"
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs")
    straight = _spec(dataset, tmp_path / "straight", strategy)
    assert wait_for_job(executor.submit(TrainingJob(straight)), print, 0.2) is not None
    resumed = _spec(dataset, tmp_path / "resumed", strategy)
    with pytest.raises(JobError, match="simulated loss of a node"):
        wait_for_job(executor.submit(StopsInEpoch2(resumed)), print, 0.2)
    capsys.readouterr()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("g", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    tracked = resumed.model_copy(update={"tracking_uri": client.tracking_uri, "run_id": run_id})
    with relaying(resumed.out_dir, client.tracking_uri, run_id, print):
        TrainingJob(tracked)()  # one rank, from the 2 ranks' checkpoint of epoch 1

    out = capsys.readouterr().out
    assert (
        "global batch 64 kept: the run started on 2 ranks and continues after epoch 1 on "
        "1 ranks x 2 micro-batches of 32 per step (gradient accumulation)" in out
    )
    params = client.get_run(run_id).data.params
    assert params["global_batch"] == "64"
    assert params["global_batch.after_epoch_1"] == (
        "1 ranks x 2 micro-batches of 32 per step (gradient accumulation)"
    )
    want, got = _final(straight.out_dir, sharded), _final(resumed.out_dir, sharded)
    assert (got["epoch"], got["step"], got["data_world"]) == (2, want["step"], 2)
    assert [h["step"] for h in got["history"]] == [h["step"] for h in want["history"]]
    assert got["history"][1]["lr"] == want["history"][1]["lr"]
    expected, actual = _tensors(want["model"]), _tensors(got["model"])
    expected |= _tensors(want["optimizer"], "optimizer")
    actual |= _tensors(got["optimizer"], "optimizer")
    assert expected.keys() == actual.keys()
    for key, value in expected.items():  # fp32: the same sums in another order (rounding)
        torch.testing.assert_close(actual[key].float(), value.float(), rtol=1e-4, atol=1e-6)
    loss = got["history"][1]["train_loss"]
    assert loss == pytest.approx(want["history"][1]["train_loss"], rel=1e-5)


def test_each_step_of_the_accumulating_rank_takes_the_samples_of_the_ranks_it_stands_for() -> None:
    split = Split(torch.zeros(203, 1), torch.zeros(203, dtype=torch.int64))
    four = [rank_batches(split, 8, seed=1, epoch=2, rank=r, world_size=4) for r in range(4)]
    steps = len(four[0])
    for world in (1, 2):
        accumulation = 4 // world
        ranks = [accumulated_batches(split, 8, 1, 2, r, world, accumulation) for r in range(world)]
        for step in range(steps):
            got = [
                ranks[r][step * accumulation + j] for r in range(world) for j in range(accumulation)
            ]
            want = [four[r][step] for r in range(4)]
            assert sorted(torch.cat(got).tolist()) == sorted(torch.cat(want).tolist()), step
        assert all(len(r) == steps * accumulation for r in ranks)


def _resumable(data_world: int) -> Resumable:
    return Resumable(Path("/runs/a/checkpoints/epoch-000006"), {"data_world": data_world})


def test_the_global_batch_is_the_one_the_run_started_with() -> None:
    two = DistContext(0, 2, 0, torch.device("cpu"), "gloo")
    assert global_batch(None, TrainConfig(batch_size=128), two).size == 256  # a fresh start
    kept = global_batch(_resumable(4), TrainConfig(batch_size=64), two)
    assert (kept.size, kept.accumulation, kept.planned) == (256, 2, 1)
    old = global_batch(_resumable(0), TrainConfig(batch_size=64), two)  # not recorded
    assert (old.size, old.accumulation) == (128, 1)


def test_a_world_that_cannot_make_up_the_global_batch_is_refused_in_one_line() -> None:
    three = DistContext(0, 3, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError) as refused:
        global_batch(_resumable(4), TrainConfig(batch_size=64), three)
    assert str(refused.value) == (
        "/runs/a/checkpoints/epoch-000006 continues a run whose global batch is 256 "
        "(train.batch_size=64 x 4 micro-batches), which 3 ranks cannot make up by gradient "
        "accumulation (3 does not divide 4): resume on 1, 2 or 4 ranks"
    )
    eight = DistContext(0, 8, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match="8 does not divide 4"):
        global_batch(_resumable(4), TrainConfig(batch_size=64, global_batch_size=256), eight)
