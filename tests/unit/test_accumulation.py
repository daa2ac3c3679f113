"""train.global_batch_size: the same optimizer steps however the ranks make them up, one DDP
all-reduce per step however many micro-batches (tasks.train.batching, tasks.train.loop).

Real rank processes: 2 gloo ranks through submitit's local executor; the one-rank run trains
in this process. The all-reduces are counted by a real DDP communication hook that does what
DDP does by default (torch's allreduce_hook), registered on the job's DDP model.
"""

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.flows.config import build_config
from trainflow.flows.preflight import check_global_batch
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.checkpointing.checkpoint import Resumable
from trainflow.tasks.train.checkpointing.sharded_checkpoint import sharded_checkpoints
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.precision import PrecisionPolicy
from trainflow.tasks.train.recipe import Recipe
from trainflow.tasks.train.resume import announce_global_batch, global_batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _counting_allreduce(
    rounds: list[int], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce of a bucket (the mean over ranks), a round counted per backward
    that reduces (its last bucket)."""
    if bucket.is_last():
        rounds[0] += 1
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


class CountsAllReduces(TrainingJob):
    """Trains as the job does, counting its DDP all-reduce rounds into rounds-<rank>.json."""

    def _trainer(
        self, built: torch.nn.Module, dist: DistContext, policy: PrecisionPolicy, *args: Any
    ) -> Trainer:
        trainer = super()._trainer(built, dist, policy, *args)
        rounds = [0]
        trainer.model.register_comm_hook(rounds, _counting_allreduce)  # type: ignore[operator]
        self.recipe = type("Counting", (_WritesRounds,), {"rounds": rounds})
        return trainer


class _WritesRounds(Recipe):
    """Trains, then writes the rounds its model's comm hook counted."""

    rounds: ClassVar[list[int]] = []

    def run(self) -> None:
        super().run()
        trainer, progress = self.trainer, self.progress
        found = {"rounds": self.rounds[0], "steps": progress.step, "micro": trainer.accumulation}
        path = self.spec.out_dir / f"rounds-{trainer.dist.rank}.json"
        path.write_text(json.dumps(found))


def _spec(dataset: DatasetRef, out_dir: Path, **batch: int) -> TrainJobSpec:
    train = TrainConfig(
        model="mlp",
        optimizer="sgd",  # Adam's step would turn rounding in ~0 gradients into whole steps
        epochs=2,
        lr=0.05,
        precision="fp32",
        device="cpu",
        seed=3,
        test_after_training=False,
        **batch,
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out_dir)


def _weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model weights (an fsdp run's sharded one gathered whole)."""
    whole = sorted((out_dir / "checkpoints").glob("epoch-*.pt"))
    if whole:
        state: dict[str, Any] = torch.load(whole[-1], weights_only=True)
    else:
        dcp_to_torch_save(sharded_checkpoints(out_dir / "checkpoints")[0], out_dir / "whole.pt")
        state = torch.load(out_dir / "whole.pt", weights_only=False)
    return {k: v.double() for k, v in state["model"].items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.services
@pytest.mark.timeout(300)
def test_a_global_batch_of_16_trains_the_same_weights_on_any_ranks_with_one_allreduce_a_step(
    tmp_path: Path,
) -> None:
    """global_batch_size=16 as 1 rank x 16, 2 ranks x 8 and 2 ranks x 4 x 2 micro-batches
    (under DDP, and under FSDP, whose SGD is then unfused):
    every step takes the same 16 samples (tasks.train.data.accumulated_batches), so the
    weights differ only by float32 rounding of sums taken in another order. The tolerance is
    that rounding's first-order bound: per step the float32 unit roundoff of the largest
    weight, over all the steps; a wrong accumulation (a gradient not averaged, or left out of
    the all-reduce) moves the weights by a whole learning-rate step, orders more; the last
    assertion shows a global batch of 8 is that far away."""
    dataset = write_dataset(tmp_path / "ds")  # 256 training samples: 16 steps an epoch
    one = _spec(dataset, tmp_path / "one", batch_size=16, global_batch_size=16)
    TrainingJob(one)()
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs")
    runs = {
        "two": _spec(dataset, tmp_path / "two", batch_size=8, global_batch_size=16),
        "micro": _spec(dataset, tmp_path / "micro", batch_size=4, global_batch_size=16),
        "half": _spec(dataset, tmp_path / "half", batch_size=4),  # global batch 8
    }
    jobs = [executor.submit(CountsAllReduces(spec)) for spec in runs.values()]
    fsdp = _spec(dataset, tmp_path / "fsdp", batch_size=4, global_batch_size=16)
    fsdp = fsdp.model_copy(update={"train": fsdp.train.model_copy(update={"strategy": "fsdp"})})
    jobs.append(executor.submit(TrainingJob(fsdp)))  # reduce-scatters every micro-batch
    for job in jobs:
        assert wait_for_job(job, print, 0.2) is not None

    want = _weights(one.out_dir)
    steps = 2 * 256 // 16
    tolerance = (
        steps * torch.finfo(torch.float32).eps * max(float(w.abs().max()) for w in want.values())
    )
    for name in ("two", "micro"):
        assert _distance(_weights(runs[name].out_dir), want) <= tolerance, name
    assert _distance(_weights(fsdp.out_dir), want) <= tolerance
    assert _distance(_weights(runs["half"].out_dir), want) > 100 * tolerance
    for rank in (0, 1):
        counted = {
            name: json.loads((spec.out_dir / f"rounds-{rank}.json").read_text())
            for name, spec in runs.items()
        }
        assert counted["two"] == {"rounds": steps, "steps": steps, "micro": 1}
        assert counted["micro"] == {"rounds": steps, "steps": steps, "micro": 2}
        assert counted["half"] == {"rounds": 2 * steps, "steps": 2 * steps, "micro": 1}


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        cfg = build_config("tiny", list(overrides))
        check_global_batch(cfg.train, cfg)
    return str(refused.value)


def test_a_global_batch_that_does_not_divide_is_refused_in_one_line_naming_what_would() -> None:
    """tiny: train.batch_size=32 on 2 ranks."""
    on_ranks = _refusal("train.global_batch_size=96")
    assert on_ranks == (
        "train.global_batch_size=96 is not a whole number of micro-batches of "
        "train.batch_size=32 on each of 2 ranks (cluster.nodes x cluster.ranks_per_node): set "
        "train.global_batch_size=64 or 128, or train.batch_size=16 or 24, or train on 1 or 3 "
        "ranks"
    )
    # the config's own refusals: its one line under the config's heading
    assert _refusal("train.global_batch_size=80").splitlines() == [
        "invalid config:",
        "  train: train.global_batch_size=80 is not a whole number of micro-batches of "
        "train.batch_size=32: set train.global_batch_size=64 or 96, or train.batch_size=20 or 40",
    ]
    assert _refusal("train.global_batch_size=128", "train.grad_accumulation=2").splitlines() == [
        "invalid config:",
        "  train: train.global_batch_size=128 and train.grad_accumulation=2 both set the "
        "gradient accumulation: set one of them (the accumulation follows from the global "
        "batch and the ranks)",
    ]
    four = build_config("tiny", ["train.global_batch_size=128", "cluster.ranks_per_node=3"])
    with pytest.raises(ConfigError, match="on each of 3 ranks"):
        check_global_batch(four.train, four)
    fine = build_config("tiny", ["train.global_batch_size=128"])
    check_global_batch(fine.train, fine)  # 2 ranks x 2 micro-batches of 32


def _resumable(data_world: int) -> Resumable:
    return Resumable(Path("/runs/a/checkpoints/epoch-000003"), {"data_world": data_world})


def test_a_configured_global_batch_is_kept_on_fewer_ranks_by_the_same_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The checkpoint's micro-batches per step decide on resume; the config's on a fresh start."""
    one, two = (DistContext(0, w, 0, torch.device("cpu"), "gloo") for w in (1, 2))
    fixed = TrainConfig(batch_size=32, global_batch_size=256)  # 8 micro-batches a step
    fresh = global_batch(None, fixed, two)
    assert (fresh.size, fresh.accumulation, fresh.planned) == (256, 4, 4)
    resumed = global_batch(_resumable(8), fixed, one)  # the config asks for 8 on 1 rank too
    assert (resumed.size, resumed.accumulation, resumed.planned) == (256, 8, 8)
    announce_global_batch(resumed, 3, None)
    assert capsys.readouterr().out == ""  # nothing kept: what the config asks for
    announce_global_batch(fresh, 0, None)
    assert capsys.readouterr().out == (
        "global batch 256: 2 ranks x 4 micro-batches of 32 per step (gradient accumulation)\n"
    )
    explicit = TrainConfig(batch_size=32, grad_accumulation=2)  # started on 4 ranks: 8
    kept = global_batch(_resumable(8), explicit, two)
    assert (kept.size, kept.accumulation, kept.planned) == (256, 4, 2)
    announce_global_batch(kept, 3, None)
    assert capsys.readouterr().out == (
        "global batch 256 kept: the run takes 8 micro-batches per step and continues after "
        "epoch 3 on 2 ranks x 4 micro-batches of 32 per step (gradient accumulation)\n"
    )
    three = DistContext(0, 3, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match=r"\(3 does not divide 8\): resume on 1, 2, 4 or 8 ranks"):
        global_batch(_resumable(8), fixed, three)
