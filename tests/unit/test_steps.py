"""Runs counted in optimizer steps (train.max_steps) and the step cadences (val_every_steps,
checkpoint_every_steps, log_every_steps): where the loop stops, and that a run stopped at
max_steps inside an epoch and extended continues exactly.

Real rank processes: 2 gloo ranks through submitit's local executor.
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
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.flows.config import build_config
from trainflow.flows.resume import build_resume
from trainflow.flows.run_record import RunRecord, write_record
from trainflow.tasks.tracking.relay import Relay
from trainflow.tasks.train.cadence import Due, run_plan
from trainflow.tasks.train.checkpointing.checkpoint import checkpoints
from trainflow.tasks.train.checkpointing.sharded_checkpoint import TRAIN_STATE, sharded_checkpoints
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.recipe import Recipe

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _boundaries(plan_keys: dict[str, int], per_epoch: int) -> list[int]:
    """Where the loop stops, walked through the plan from step 0."""
    plan = run_plan(TrainConfig(**plan_keys), per_epoch)
    found, step = [], 0
    while step < plan.total_steps:
        step = plan.next_boundary(step)
        found.append(step)
    return found


def test_the_loop_stops_at_each_epoch_end_cadence_step_and_the_last_step() -> None:
    keys = {"max_steps": 17, "val_every_steps": 5, "checkpoint_every_steps": 4}
    expected = sorted({s for s in range(1, 18) if s % 7 == 0 or s % 5 == 0 or s % 4 == 0} | {17})
    assert _boundaries(keys, 7) == expected
    plan = run_plan(TrainConfig(**keys, log_every_steps=3), 7)
    due = plan.due(15)  # a validation, not a checkpoint, a log, not an epoch's end
    assert (due.validate, due.checkpoint, due.log, due.epoch_end) == (True, False, True, False)
    assert plan.due(17).final and plan.due(17).checkpoint and not plan.due(17).epoch_end
    # the time-limit watch plans to the next pause that is more than a log
    assert [plan.next_pause(s) for s in (0, 3, 4, 5, 13, 15, 16)] == [4, 4, 5, 7, 14, 16, 17]


def test_the_length_is_epochs_or_max_steps_whichever_comes_first() -> None:
    assert run_plan(TrainConfig(), 10).total_steps == 80  # neither set: 8 epochs, as always
    assert run_plan(TrainConfig(max_steps=25), 10).total_steps == 25  # steps alone
    assert run_plan(TrainConfig(max_steps=25), 10).epochs == 3
    assert run_plan(TrainConfig(epochs=2, max_steps=25), 10).total_steps == 20
    assert run_plan(TrainConfig(epochs=4, max_steps=25), 10).total_steps == 25
    assert _boundaries({"epochs": 2}, 10) == [10, 20]


@pytest.mark.parametrize(
    "override", ["train.max_steps=0", "train.val_every_steps=-1", "train.log_every_steps=0"]
)
def test_a_step_key_out_of_range_is_refused_before_anything_runs(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as refused:
        build_config("demo", [override])
    header, *lines = str(refused.value).splitlines()  # the project's "invalid config:" form
    assert header == "invalid config:" and len(lines) == 1 and key in lines[0]


# A recipe's keys whose learning rate does not depend on the run's length (a constant after a
# warm-up), with clipping: extending max_steps then changes nothing already trained.
KEYS = {"schedule": "constant", "warmup_steps": 3, "max_grad_norm": 0.5}


def _spec(
    dataset: Any, out: Path, strategy: str, batch_size: int = 32, **keys: Any
) -> TrainJobSpec:
    train = TrainConfig(
        model="mlp",
        strategy=strategy,
        batch_size=batch_size,
        precision="fp32",
        device="cpu",
        seed=3,
        **KEYS,
        **keys,
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out)


def _final(out_dir: Path, sharded: bool) -> dict[str, Any]:
    """The newest checkpoint's whole state: progress, model and optimizer."""
    if not sharded:
        return dict(torch.load(checkpoints(out_dir / "checkpoints")[0], weights_only=True))
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_stopped_at_max_steps_inside_an_epoch_and_extended_equals_a_straight_run(
    tmp_path: Path, strategy: str
) -> None:
    # 256 samples: 4 steps an epoch on 2 ranks, each step 2 micro-batches of 16 per rank
    dataset = write_dataset(tmp_path / "ds")
    sharded = strategy == "fsdp"
    run = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs").submit
    accumulated = {"batch_size": 16, "grad_accumulation": 2}
    straight = _spec(dataset, tmp_path / "straight", strategy, max_steps=12, **accumulated)
    assert wait_for_job(run(TrainingJob(straight)), print, 0.2) is not None
    # Validating every 3 steps and logging every 2 cuts the epochs into more segments: the
    # same steps all the same. The first job ends at step 6, 2 steps into epoch 2.
    cadence = {"val_every_steps": 3, "log_every_steps": 2, **accumulated}
    first = _spec(dataset, tmp_path / "extended", strategy, max_steps=6, **cadence)
    assert wait_for_job(run(TrainingJob(first)), print, 0.2) is not None
    stopped = _final(first.out_dir, sharded)
    assert (stopped["epoch"], stopped["epoch_batches"], stopped["step"]) == (1, 2, 6)
    extended = _spec(dataset, tmp_path / "extended", strategy, max_steps=12, **cadence)
    assert wait_for_job(run(TrainingJob(extended)), print, 0.2) is not None

    want, got = _final(straight.out_dir, sharded), _final(extended.out_dir, sharded)
    assert got["step"] == want["step"] == 12 and got["epoch"] == want["epoch"] == 3
    for part in ("model", "optimizer"):
        expected, resumed = _tensors(want[part]), _tensors(got[part])
        assert expected.keys() == resumed.keys() and expected
        for name, tensor in expected.items():
            assert torch.equal(resumed[name], tensor), f"{part}{name} differs"
    # a validation at every 3rd step, each epoch's end (4 steps) and the first job's last
    assert [h["step"] for h in got["history"]] == sorted({3, 6, 9, 12} | {4, 8, 12})
    assert [h["step"] for h in want["history"]] == [4, 8, 12]
    assert "grad_norm" in got["history"][-1]


def test_a_resume_may_raise_max_steps_but_not_lower_it(tmp_path: Path) -> None:
    fsdp = ["train.strategy=fsdp", "train.parallel.tp=2"]
    cfg = build_config("demo", ["train.max_steps=40", "train.log_every_steps=5", *fsdp])
    run_dir = tmp_path / "runs" / "0123abcd"
    run_dir.mkdir(parents=True)
    config = cfg.model_dump(mode="json")
    record = RunRecord(
        parent_run_id="0123abcd",
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        config=config,
        host="another-host",  # not a flow process of this host: not running
        pid=1,
        started=0.0,
    )
    write_record(run_dir, record)
    longer, _, _ = build_resume(str(run_dir), tmp_path, ["train.max_steps=80"])
    assert longer.train.max_steps == 80 and longer.train.log_every_steps == 5
    cadence, _, _ = build_resume(str(run_dir), tmp_path, ["train.checkpoint_every_steps=10"])
    assert cadence.train.checkpoint_every_steps == 10
    with pytest.raises(ConfigError, match=r"train\.max_steps=20 is below the run's 40"):
        build_resume(str(run_dir), tmp_path, ["train.max_steps=20"])
    with pytest.raises(ConfigError, match=r"--set train\.val_every_steps: a resumed run keeps"):
        build_resume(str(run_dir), tmp_path, ["train.val_every_steps=10"])
    moved, _, _ = build_resume(str(run_dir), tmp_path, ["train.parallel.tp=1"])  # another mesh
    assert moved.train.parallel.tp == 1 and moved.train.strategy == "fsdp"


def _logged_run(dataset: Any, out: Path, uri: str, log_every: int) -> dict[str, list[Any]]:
    """Train one process to step 10 (8 steps an epoch) logging every `log_every` steps and
    validating every 5; the MLflow run's metric histories."""
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(out.name)).info.run_id
    train = TrainConfig(
        batch_size=32,
        precision="fp32",
        device="cpu",
        seed=3,
        max_steps=10,
        val_every_steps=5,
        log_every_steps=log_every,
        **KEYS,
    )
    spec = TrainJobSpec(train=train, dataset=dataset, out_dir=out, tracking_uri=uri, run_id=run_id)
    TrainingJob(spec)()
    Relay(spec.out_dir, uri, run_id, say=print).finish()  # the flow sends the journal
    names = ("train_loss_step", "lr_step", "grad_norm_step", "samples_per_s_step", "val_loss")
    return {name: client.get_metric_history(run_id, name) for name in names}


@pytest.mark.services
def test_per_step_metrics_reach_mlflow_on_the_global_step_axis(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds")  # 256 samples: 8 steps an epoch on one rank
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    every3 = _logged_run(dataset, tmp_path / "every3", uri, 3)
    assert [m.step for m in every3["train_loss_step"]] == [3, 6, 9]
    assert [m.step for m in every3["grad_norm_step"]] == [3, 6, 9]
    assert all(m.value > 0 for m in every3["samples_per_s_step"])
    # lr_step is each window's last step's: a linear warm-up over 3 steps (step 0 at 0), then
    # the peak (transformers' constant schedule with warm-up), computed here.
    peak = TrainConfig().lr
    assert [m.value for m in every3["lr_step"]] == pytest.approx([peak * 2 / 3, peak, peak])
    # validations: every 5 steps, the epoch's end (8) and the last step (10), on steps too
    assert [m.step for m in every3["val_loss"]] == [5, 8, 10]
    # The same steps logged one by one: each 3-step window is their mean (equal batches).
    every1 = _logged_run(dataset, tmp_path / "every1", uri, 1)
    single = [m.value for m in every1["train_loss_step"]]
    assert [m.step for m in every1["train_loss_step"]] == list(range(1, 11))
    windows = [sum(single[i : i + 3]) / 3 for i in (0, 3, 6)]
    assert [m.value for m in every3["train_loss_step"]] == pytest.approx(windows, rel=1e-9)


class _LostAfterStep6(Recipe):
    """Dies as a preempted job does: after the checkpoint of step 6, before epoch 1 ends."""

    def segment(self) -> tuple[dict[str, float], Due]:
        if self.progress.step >= 6:
            raise RuntimeError("simulated preemption")
        return super().segment()


class _StopsAfterStep6(TrainingJob):
    recipe = _LostAfterStep6


def test_a_run_lost_between_step_checkpoints_resumes_from_the_last_one_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write_dataset(tmp_path / "ds")  # 256 samples: 8 steps an epoch on one rank
    keys = {"epochs": 2}
    TrainingJob(_spec(dataset, tmp_path / "straight", "ddp", **keys))()
    spec = _spec(dataset, tmp_path / "lost", "ddp", checkpoint_every_steps=3, **keys)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        _StopsAfterStep6(spec)()
    names = sorted(p.name for p in (spec.checkpoint_dir).glob("epoch-*.pt"))
    assert names[-1] == "epoch-000000+000006.pt"  # steps 3 and 6, inside the first epoch
    capsys.readouterr()
    TrainingJob(spec)()
    assert "after epoch 0, step 6" in capsys.readouterr().out
    want, got = _final(tmp_path / "straight", False), _final(spec.out_dir, False)
    assert got["step"] == want["step"] == 16
    for part in ("model", "optimizer"):
        expected, resumed = _tensors(want[part]), _tensors(got[part])
        for name, tensor in expected.items():
            assert torch.equal(resumed[name], tensor), f"{part}{name} differs"
    assert [h["step"] for h in got["history"]] == [8, 16]  # validations: each epoch's end
