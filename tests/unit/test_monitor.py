"""train.monitor, train.keep_checkpoints and early stopping (tasks.train.monitor).

The rules on hand-worked sequences, then real training jobs (2 gloo ranks through submitit's
local executor, nothing mocked): early stopping ends a diverging run and leaves a healthy one
alone, a resumed run keeps its count, and a run keeps exactly the k best checkpoints by the
monitor plus the newest, under ddp and fsdp. Every expectation of a real run is computed here
from the run's logged history (history.json), not by the code under test.
"""

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.errors import ConfigError
from trainflow.tasks.objectives import make_objective
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job import EpochEnd, Progress, TrainingJob, TrainJobSpec
from trainflow.tasks.train.monitor import Monitor, check_monitor, monitor_for, top_k
from trainflow.tasks.train.ref import CheckpointRef

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _observe_all(monitor: Monitor, values: list[float]) -> tuple[Progress, int, str]:
    """Feed `values` as epochs 1, 2, ... until a stop: (the progress, the stop epoch or 0,
    the stop line)."""
    progress = Progress(data_seed=0)
    for epoch, value in enumerate(values, start=1):
        progress.epoch = epoch
        verdict = monitor.observe(progress, {monitor.metric: value, "val_other": 0.0})
        if verdict.stop:
            return progress, epoch, verdict.line
    return progress, 0, ""


def test_patience_counts_validations_without_an_improvement_by_more_than_min_delta() -> None:
    monitor = Monitor("val_loss", higher=False, patience=2, min_delta=0.05)
    # 1.0; 0.9 improves by 0.1 (counts); 0.88 and 0.87 by 0.02 and 0.03 from 0.9: two stale
    progress, stopped, line = _observe_all(monitor, [1.0, 0.9, 0.88, 0.87, 0.5])
    assert stopped == 4
    assert (progress.best_epoch, progress.best_metric) == (4, 0.87)  # best.pt: any improvement
    assert line == (
        "early stop at epoch 4: val_loss has not improved by more than 0.05 for 2 "
        "validations (best 0.87 at epoch 4)"
    )


def test_a_higher_is_better_metric_a_tie_and_nan() -> None:
    accuracy = Monitor("val_accuracy", higher=True, patience=1)
    progress, stopped, _ = _observe_all(accuracy, [0.5, 0.6, 0.6])
    assert (stopped, progress.best_epoch) == (3, 2)  # a tie is no improvement
    loss = Monitor("val_loss", higher=False, patience=2)
    progress, stopped, _ = _observe_all(loss, [1.0, math.nan, math.nan])
    assert (stopped, progress.best_epoch) == (3, 1)  # a diverged run stops
    progress, stopped, _ = _observe_all(loss, [math.nan, 2.0, 1.0])
    assert (stopped, progress.best_epoch) == (0, 3)  # anything measured beats nan
    assert _observe_all(Monitor("val_loss", False), [1.0] * 20)[1] == 0  # patience 0: never


def test_top_k_keeps_the_k_best_and_the_newest() -> None:
    newest_first = [("e5", 0.4), ("e4+10", None), ("e4", 0.1), ("e3", 0.3), ("e2", 0.1)]
    assert top_k(newest_first, 2, higher=False) == {"e5", "e2", "e4"}
    assert top_k(newest_first, 1, higher=False) == {"e5", "e2"}  # a tie: the older
    assert top_k(newest_first, 1, higher=True) == {"e5"}
    assert top_k([("e4+10", None), ("e4", 0.1), ("e3", 0.3)], 1, False) == {"e4+10", "e4"}


def test_retain_reads_each_checkpoints_validation_from_the_history() -> None:
    """Files and sharded folders alike; a checkpoint inside an epoch (before a time limit)
    follows no validation; without keep_checkpoints, the two newest."""
    history = [{"epoch": e, "val_loss": v} for e, v in ((1, 0.9), (2, 0.5), (3, 0.7))]
    for suffix in (".pt", ""):
        names = ["epoch-000003+000002", "epoch-000003", "epoch-000002", "epoch-000001"]
        newest_first = [Path(f"/c/{n}{suffix}") for n in names]
        best_one = Monitor("val_loss", higher=False, keep=1)
        assert best_one.retain(newest_first, history) == {
            f"epoch-000003+000002{suffix}",
            f"epoch-000002{suffix}",
        }
        worst_two = Monitor("val_loss", higher=True, keep=2)
        assert worst_two.retain(newest_first[1:], history) == {
            f"epoch-000003{suffix}",
            f"epoch-000001{suffix}",
        }
        default = Monitor("val_loss", higher=False).retain(newest_first, history)
        assert default == {f"epoch-000003+000002{suffix}", f"epoch-000003{suffix}"}
        # a validation inside an epoch (train.val_every_steps) scores the checkpoint there
        inside = [*history, {"epoch": 3, "epoch_batches": 2, "step": 32, "val_loss": 0.1}]
        newest = [Path(f"/c/{n}{suffix}") for n in ["epoch-000004", *names]]
        assert best_one.retain(newest, inside) == {
            f"epoch-000004{suffix}",
            f"epoch-000003+000002{suffix}",
        }


def test_a_run_counting_steps_says_the_steps_in_its_stop_line() -> None:
    progress = Progress(data_seed=0, by_step=True)
    monitor = Monitor("val_loss", higher=False, patience=1)
    for step, value in ((50, 1.0), (100, 0.5), (150, 0.7)):
        entry = {"epoch": 0, "epoch_batches": step, "step": step, "val_loss": value}
        progress.history.append(entry)
        verdict = monitor.observe(progress, {"val_loss": value}, len(progress.history))
    assert verdict.line == (
        "early stop at step 150: val_loss has not improved by more than 0 for 1 validations "
        "(best 0.5 at step 100)"
    )


def test_monitor_defaults_to_the_objective_and_is_checked_against_its_metrics(
    dataset: DatasetRef,
) -> None:
    objective = make_objective("classification", dataset_spec(dataset, "classification"))
    default = monitor_for(TrainConfig(), objective)
    assert (default.metric, default.higher) == ("val_accuracy", True)
    loss = monitor_for(TrainConfig(monitor="val_loss"), objective)
    assert (loss.metric, loss.higher) == ("val_loss", False)
    assert monitor_for(TrainConfig(monitor="val_loss", monitor_mode="max"), objective).higher
    with pytest.raises(ConfigError, match=r"train.monitor=val_f1 .* val_accuracy, val_loss$"):
        check_monitor(TrainConfig(monitor="val_f1"), objective)
    with pytest.raises(ValueError, match=r"train\.monitor=loss is not a validation metric"):
        TrainConfig(monitor="loss")
    with pytest.raises(ValueError, match=r"early_stop_min_delta=0\.1 has no effect"):
        TrainConfig(early_stop_min_delta=0.1)


# --- real runs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _spec(dataset: DatasetRef, out_dir: Path, **train: Any) -> TrainJobSpec:
    cfg = TrainConfig(batch_size=32, device="cpu", precision="fp32", **train)
    return TrainJobSpec(train=cfg, dataset=dataset, out_dir=out_dir)


def _run(
    spec: TrainJobSpec, jobs: Path, epoch_end: EpochEnd | None = None
) -> tuple[CheckpointRef, list[dict[str, Any]], list[str]]:
    """Train `spec` on 2 ranks: its CheckpointRef, its logged history and its output lines."""
    executor = make_executor(ClusterConfig(ranks_per_node=2, timeout_min=5), jobs)
    lines: list[str] = []
    job = executor.submit(TrainingJob(spec, epoch_end))
    ref = wait_for_job(job, lines.append, poll_s=0.2)
    assert isinstance(ref, CheckpointRef)  # the job ended well: the run FINISHED
    history: list[dict[str, Any]] = json.loads(ref.history_path.read_text())
    return ref, history, lines


def _expected_stop(losses: list[float], patience: int, min_delta: float = 0.0) -> int:
    """The epoch a lower-is-better metric with these values stops at (0: none), worked out
    here: a value counts as an improvement when it is below the last one that was by more
    than min_delta (nan never is)."""
    reference, stale = losses[0], 0
    for epoch, value in enumerate(losses[1:], start=2):
        if reference - value > min_delta or (math.isnan(reference) and not math.isnan(value)):
            reference, stale = value, 0
        else:
            stale += 1
        if stale >= patience:
            return epoch
    return 0


def _first_best(losses: list[float]) -> int:
    """The epoch of the lowest value (the first of equals; nan never)."""
    finite = [(v, e) for e, v in enumerate(losses, start=1) if not math.isnan(v)]
    return min(finite)[1]


@pytest.mark.services
def test_early_stopping_ends_a_diverging_run_finished_and_spares_a_healthy_one(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    """~15 s: two 2-rank runs of a few epochs."""
    # SGD warmed up to lr 10 over the run: it learns in the first epoch, then blows up
    diverging = _spec(
        dataset, tmp_path / "bad", epochs=8, lr=10.0, optimizer="sgd", schedule="constant",
        warmup_fraction=0.95, monitor="val_loss", early_stop_patience=2,
    )  # fmt: skip
    ref, history, lines = _run(diverging, tmp_path / "jobs")
    losses = [h["val_loss"] for h in history]
    stop = _expected_stop(losses, 2)
    assert 0 < stop < 8 and len(history) == stop, losses
    best = _first_best(losses)
    said = [line for line in lines if "early stop" in line]
    assert said == [
        f"[rank0] early stop at epoch {stop}: val_loss has not improved by more than 0 for 2 "
        f"validations (best {losses[best - 1]:.6g} at epoch {best})"
    ]
    assert ref.epoch == best  # what evaluation takes: the monitor's best
    assert torch.load(ref.path, weights_only=True)["meta"]["epoch"] == best

    healthy = _spec(dataset, tmp_path / "good", epochs=4, monitor="val_loss", early_stop_patience=2)
    _, history, lines = _run(healthy, tmp_path / "jobs")
    assert _expected_stop([h["val_loss"] for h in history], 2) == 0  # it did improve
    assert len(history) == 4 and not any("early stop" in line for line in lines)


@pytest.mark.services
def test_a_resumed_run_keeps_its_patience_count(dataset: DatasetRef, tmp_path: Path) -> None:
    """~15 s: a run that cannot improve by min_delta (lr 1e-9) ends by its epochs before its
    patience runs out, then is extended (train.epochs may change on resume): it stops where
    the whole history says, counting the validations of the first job."""
    out, delta = tmp_path / "run", 1e-3
    train = {"lr": 1e-9, "monitor": "val_loss", "early_stop_patience": 3}
    _, first, _ = _run(
        _spec(dataset, out, epochs=3, early_stop_min_delta=delta, **train), tmp_path / "jobs"
    )
    first_losses = [h["val_loss"] for h in first]
    assert _expected_stop(first_losses, 3, delta) == 0
    _, history, lines = _run(
        _spec(dataset, out, epochs=12, early_stop_min_delta=delta, **train), tmp_path / "jobs"
    )
    assert any("resuming from" in line for line in lines)
    stop = _expected_stop([h["val_loss"] for h in history], 3, delta)
    assert stop and len(history) == stop
    # the first job left 2 stale validations: a count lost on resume would stop 2 epochs later
    assert stop == 4 and history[:3] == first


@pytest.mark.services
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_keep_checkpoints_keeps_the_k_best_by_the_monitor_and_the_newest(
    dataset: DatasetRef, tmp_path: Path, strategy: str
) -> None:
    """~10 s each. monitor_mode=max on val_loss ranks a learning run's early epochs best, so
    the k best are not the newest (which the default keeps)."""
    spec = _spec(
        dataset, tmp_path / "run", epochs=5, monitor="val_loss", monitor_mode="max",
        keep_checkpoints=2, strategy=strategy,
    )  # fmt: skip
    ref, history, _ = _run(spec, tmp_path / "jobs")
    by_loss = sorted(history, key=lambda h: (-h["val_loss"], h["epoch"]))
    expected = {int(h["epoch"]) for h in by_loss[:2]} | {5}
    assert expected != {4, 5}, [h["val_loss"] for h in history]  # not what the default keeps
    suffix = ".pt" if strategy == "ddp" else ""
    kept = {p.name for p in (spec.out_dir / "checkpoints").iterdir() if p.suffix != ".sha256"}
    assert kept == {f"epoch-{e:06d}{suffix}" for e in expected}
    assert ref.epoch == by_loss[0]["epoch"]  # best.pt: the highest val_loss


@pytest.mark.services
def test_early_stopping_inside_an_epoch_checkpoints_the_stop_and_a_resume_trains_no_further(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    """~10 s: a run counted in steps (16 an epoch, max_steps 14) validates every 3 steps and
    checkpoints every 4; it cannot improve by min_delta (lr 1e-9), so it stops at its third
    validation, step 9, inside the epoch: the stop is checkpointed there (no cadence asked for
    it), the line says steps, and the same run resumed trains no further."""
    cfg = TrainConfig(
        batch_size=8, device="cpu", precision="fp32", max_steps=14, lr=1e-9,
        val_every_steps=3, checkpoint_every_steps=4, monitor="val_loss", keep_checkpoints=1,
        early_stop_patience=2, early_stop_min_delta=1e-3,
    )  # fmt: skip
    spec = TrainJobSpec(train=cfg, dataset=dataset, out_dir=tmp_path / "run")
    _, history, lines = _run(spec, tmp_path / "jobs")
    assert [(h["epoch"], h.get("epoch_batches"), h["step"]) for h in history] == [
        (0, 3, 3),
        (0, 6, 6),
        (0, 9, 9),
    ]
    losses = [h["val_loss"] for h in history]
    best = 3 * _first_best(losses)
    said = [line for line in lines if "early stop" in line]
    assert said == [
        "[rank0] early stop at step 9: val_loss has not improved by more than 0.001 for 2 "
        f"validations (best {min(losses):.6g} at step {best})"
    ]
    folder = spec.out_dir / "checkpoints"
    kept = sorted(p.name for p in folder.iterdir())
    # steps 4 and 8 followed no validation: each kept only while the newest
    assert kept == ["epoch-000000+000009.pt", "epoch-000000+000009.pt.sha256"]
    _, again, lines = _run(spec, tmp_path / "jobs")
    assert any("resuming from" in line for line in lines)
    assert again == history and sorted(p.name for p in folder.iterdir()) == kept


class _Pruner:
    """A search's epoch_end as tasks.search.trial_worker's: says when it is asked (rank 0),
    prunes after epoch `prune_at` (0: never; the same answer on every rank)."""

    def __init__(self, prune_at: int = 0) -> None:
        self.prune_at = prune_at

    def __call__(self, epoch: int, metrics: dict[str, float], dist: DistContext) -> bool:
        if dist.is_main:  # one write: the recorder thread prints its lines meanwhile
            sys.stdout.write(f"pruner asked after epoch {epoch}\n")
            sys.stdout.flush()
        return epoch == self.prune_at


@pytest.mark.services
@pytest.mark.parametrize("prune_at", [0, 3])
def test_the_pruner_asks_first_and_early_stopping_after_the_same_validation(
    dataset: DatasetRef, tmp_path: Path, prune_at: int
) -> None:
    """~6 s each. A run that cannot improve by min_delta stops early after epoch 3 (patience
    2); the pruner is asked after every validation, that one included, and when it prunes
    there, the trial is pruned, not early-stopped."""
    spec = _spec(
        dataset, tmp_path / "run", epochs=6, lr=1e-9, monitor="val_loss",
        early_stop_patience=2, early_stop_min_delta=1e-3,
    )  # fmt: skip
    _, history, lines = _run(spec, tmp_path / "jobs", _Pruner(prune_at))
    assert len(history) == 3
    # (rank 0's recorder thread prints the epoch lines: a line may hold both threads' text)
    out = "\n".join(lines)
    assert re.findall(r"pruner asked after epoch (\d+)", out) == ["1", "2", "3"]
    assert out.count("early stop at epoch 3") == (0 if prune_at else 1)
