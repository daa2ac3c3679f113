"""Sharded checkpoints of train.strategy=fsdp jobs (tasks.train.checkpointing.sharded_checkpoint),
for real:
2 gloo ranks through submitit's local executor, and the job in this process (one rank: the
same DCP files, written and read without a process group)."""

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.cadence import Due
from trainflow.tasks.train.checkpointing.checkpoint import Resumable
from trainflow.tasks.train.checkpointing.sharded_checkpoint import (
    SUMS,
    TRAIN_STATE,
    sharded_checkpoints,
)
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.model_plugins import check_model
from trainflow.tasks.train.models import mlp
from trainflow.tasks.train.progress import Progress
from trainflow.tasks.train.recipe import Recipe
from trainflow.tasks.train.ref import CheckpointRef

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _spec(dataset: DatasetRef, out_dir: Path, epochs: int) -> TrainJobSpec:
    train = TrainConfig(
        model="mlp",
        strategy="fsdp",
        epochs=epochs,
        batch_size=32,
        precision="fp32",
        device="cpu",
        seed=3,
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out_dir)


def _full_state(trainer: Trainer) -> dict[str, Any]:
    """The whole model and optimizer state, gathered (collective), on the host."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optimizer = get_state_dict(trainer.model, trainer.optimizer, options=options)
    return {"model": model, "optimizer": optimizer}


class _DumpsRecords(Recipe):
    def record(self, *args: Any) -> None:
        super().record(*args)
        state = _full_state(self.trainer)
        if self.trainer.dist.is_main:
            torch.save(state, self.spec.out_dir / f"full-{self.progress.epoch}.pt")


class DumpsSavedState(TrainingJob):
    """Also writes the whole state it checkpoints each epoch to full-<epoch>.pt (rank 0)."""

    recipe = _DumpsRecords


class DumpsResumedState(TrainingJob):
    """Writes the whole state it resumed with to resumed.pt (rank 0)."""

    def _resume(self, trainer: Trainer, found: Resumable | None, *args: Any) -> Progress:
        progress = super()._resume(trainer, found, *args)
        state = _full_state(trainer)
        if trainer.dist.is_main:
            torch.save({**state, "epoch": progress.epoch}, self.spec.out_dir / "resumed.pt")
        return progress


class _CrashesInEpoch2(Recipe):
    def segment(self) -> tuple[dict[str, float], Due]:
        if self.progress.epoch >= 1:
            raise RuntimeError("simulated preemption")
        return super().segment()


class CrashAfterFirstEpoch(TrainingJob):
    """Dies as a preempted job would: after epoch 1 was checkpointed, before epoch 2 ends."""

    recipe = _CrashesInEpoch2


class _HeldBeforeEpoch3(Recipe):
    def segment(self) -> tuple[dict[str, float], Due]:
        gate = self.spec.out_dir.with_suffix(".gate")
        while self.trainer.dist.is_main and self.progress.epoch + 1 == 3 and not gate.exists():
            time.sleep(0.05)
        return super().segment()


class HeldBeforeEpoch3(TrainingJob):
    """Rank 0 waits before epoch 3 until the file `<out_dir>.gate` exists (rank 1 waits in
    epoch 3's first collective, as a rank whose peer is slow does: it fails, hence exits, when
    rank 0 leaves); the requeued attempt (a new instance made by `checkpoint`) waits on the
    same file."""

    recipe = _HeldBeforeEpoch3


def _assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    else:
        assert a == b


@pytest.mark.services
def test_two_fsdp_ranks_write_a_shard_each_keep_two_and_resume_on_one_rank(
    tmp_path: Path,
) -> None:
    # 257 validation samples: rank 0 evaluates 2 batches of 128, rank 1 one; under FSDP every
    # forward gathers from both ranks, so rank 1 runs a padding pass (or both would wait).
    dataset = write_dataset(tmp_path / "uneven", n_val=257)
    out = tmp_path / "run"
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs")
    job = executor.submit(DumpsSavedState(_spec(dataset, out, 3)))
    ref = wait_for_job(job, print, 0.2)

    assert isinstance(ref, CheckpointRef)
    for rank in (0, 1):  # a clean exit: no abort in the process group's teardown
        ended = json.loads((job.paths.folder / f"{job.job_id}_{rank}_exit.json").read_text())
        assert (ended["returncode"], ended["signal"]) == (0, None), ended
        log = (job.paths.folder / f"{job.job_id}_{rank}_log.err").read_text()
        assert "terminate called" not in log
    folders = sharded_checkpoints(out / "checkpoints")
    assert [f.name for f in folders] == ["epoch-000003", "epoch-000002"]  # the last two
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(
        f.name for f in folders
    )
    files = {p.name for p in folders[0].iterdir()}
    assert files == {"__0_0.distcp", "__1_0.distcp", ".metadata", TRAIN_STATE, SUMS}
    listed = {line.split("  ")[1] for line in (folders[0] / SUMS).read_text().splitlines()}
    assert listed == files - {SUMS}
    # best.pt holds the whole weights: a plain model loads them, as after a DDP run
    spec = DataSpec((1, 12, 12), "float32", "classification", 4, ())
    best = torch.load(ref.path, weights_only=True)
    mlp(spec).load_state_dict(best["model"])

    # the same run continues on one rank: resharded to whole tensors, equal to what was saved
    more = _spec(dataset, out, 4)
    ref = DumpsResumedState(more)()
    resumed = torch.load(out / "resumed.pt", weights_only=True)
    assert resumed.pop("epoch") == 3
    _assert_same_state(torch.load(out / "full-3.pt", weights_only=True), resumed)
    assert ref is not None
    assert [h["epoch"] for h in json.loads(ref.history_path.read_text())] == [1, 2, 3, 4]


def _final(out_dir: Path) -> dict[str, Any]:
    """The newest checkpoint's train state, and its weights and optimizer state read as the
    docs (training.md) say to load one elsewhere (DCP's one-file conversion, no trainflow)."""
    folder = sharded_checkpoints(out_dir / "checkpoints")[0]
    state: dict[str, Any] = torch.load(folder / TRAIN_STATE, weights_only=True)
    dcp_to_torch_save(folder, out_dir / "whole.pt")
    state["whole"] = torch.load(out_dir / "whole.pt", weights_only=False)
    return state


def test_a_resumed_fsdp_job_ends_exactly_where_an_uninterrupted_one_does(
    dataset: DatasetRef, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    TrainingJob(_spec(dataset, tmp_path / "straight", 2))()
    interrupted = _spec(dataset, tmp_path / "resumed", 2)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        CrashAfterFirstEpoch(interrupted)()
    capsys.readouterr()
    TrainingJob(interrupted)()
    assert "after epoch 1" in capsys.readouterr().out
    straight, resumed = _final(tmp_path / "straight"), _final(tmp_path / "resumed")
    assert resumed["epoch"] == straight["epoch"] == 2 and resumed["step"] == straight["step"]
    assert resumed["best_epoch"] == straight["best_epoch"]

    assert _comparable(straight["history"]) == _comparable(resumed["history"])
    assert straight["whole"].keys() == {"model", "optimizer"}
    _assert_same_state(straight["whole"], resumed["whole"])


@pytest.mark.services
@pytest.mark.timeout(180)
def test_two_fsdp_ranks_requeued_mid_run_end_exactly_where_an_uninterrupted_run_does(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    # Held before epoch 3, both ranks get SIGUSR2 (what Slurm or submitit's local controller
    # sends before a time limit): the job checkpoints, is requeued, and the new attempt (2 new
    # rank processes) resumes from the sharded checkpoint and finishes epoch 3.
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), tmp_path / "jobs")
    requeued = _spec(dataset, tmp_path / "requeued", 3)
    job = executor.submit(HeldBeforeEpoch3(requeued))
    lines: list[str] = []

    def requeue_at_epoch_2(line: str) -> None:
        lines.append(line)
        if "epoch 2/3" in line and not any("resuming from" in ln for ln in lines[:-1]):
            for rank in psutil.Process(job._process.pid).children():  # type: ignore[attr-defined]
                rank.send_signal(signal.SIGUSR2)
        if "resuming from" in line:
            requeued.out_dir.with_suffix(".gate").touch()

    assert isinstance(wait_for_job(job, requeue_at_epoch_2, 0.2), CheckpointRef)
    assert any("resuming from" in line for line in lines), lines[-20:]
    straight = _spec(dataset, tmp_path / "straight", 3)
    assert isinstance(
        wait_for_job(executor.submit(TrainingJob(straight)), print, 0.2), CheckpointRef
    )

    want, got = _final(straight.out_dir), _final(requeued.out_dir)
    assert (got["epoch"], got["step"], got["best_epoch"]) == (3, want["step"], want["best_epoch"])
    assert _comparable(got["history"]) == _comparable(want["history"])
    _assert_same_state(want["whole"], got["whole"])


def _comparable(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history less its wall-clock figures (times, throughput)."""
    return [{k: v for k, v in h.items() if _compared(k)} for h in history]


def _compared(key: str) -> bool:
    return key in ("epoch", "step", "lr") or key.startswith(("train_", "val_"))


def test_a_damaged_newest_shard_is_skipped_and_the_one_before_resumed(
    dataset: DatasetRef, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(dataset, tmp_path, 2)
    TrainingJob(spec)()
    newest = sharded_checkpoints(tmp_path / "checkpoints")[0]
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    TrainingJob(_spec(dataset, tmp_path, 3))()
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {newest} __0_0.distcp does not match" in out
    assert "after epoch 1" in out


def test_a_run_cannot_switch_strategy_on_resume(dataset: DatasetRef, tmp_path: Path) -> None:
    TrainingJob(_spec(dataset, tmp_path, 1))()  # fsdp: a sharded checkpoint
    ddp = _spec(dataset, tmp_path, 2)
    ddp = ddp.model_copy(update={"train": ddp.train.model_copy(update={"strategy": "ddp"})})
    with pytest.raises(ConfigError, match=r"train.strategy=fsdp run \(epoch-000001\), which a"):
        TrainingJob(ddp)()


def test_preflight_refuses_shard_units_that_are_not_the_models_own() -> None:
    cfg = TrainConfig(model=f"{__name__}:stray_units", strategy="fsdp")
    spec = DataSpec((4,), "float32", "classification", 2, ())
    with pytest.raises(ConfigError, match="not submodules of the model"):
        check_model(cfg, spec)


class _Stray(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def shard_units(self) -> list[torch.nn.Module]:
        return [torch.nn.Linear(4, 2)]


def stray_units(spec: DataSpec) -> torch.nn.Module:
    """A model factory whose model names a module of its own making as a sharding unit."""
    return _Stray()
