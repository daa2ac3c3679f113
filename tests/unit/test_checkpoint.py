"""Checkpoints: atomic writes, weights_only round trips, and exact resume of a training job."""

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from tests.unit.datasets import write_dataset
from trainflow.errors import ConfigError, DataError
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.relay import Relay
from trainflow.tasks.train.cadence import Due
from trainflow.tasks.train.checkpointing.checkpoint import (
    atomic_save,
    latest_checkpoint,
    load_state,
    restore_rng,
    resumable_checkpoint,
    save_best,
    save_checkpoint,
    training_state,
)
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.recipe import Recipe


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _spec(dataset: DatasetRef, out_dir: Path, epochs: int, **keys: Any) -> TrainJobSpec:
    train = TrainConfig(
        epochs=epochs, batch_size=32, precision="fp32", device="cpu", seed=3, **keys
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out_dir)


# A recipe's keys: warm-up, a wsd schedule to a floor, clipping on every step.
RECIPE = {"schedule": "wsd", "warmup_fraction": 0.25, "min_lr_ratio": 0.1, "max_grad_norm": 0.1}


class _CrashesInEpoch2(Recipe):
    crash_after = 1

    def segment(self) -> tuple[dict[str, float], Due]:
        if self.progress.epoch >= self.crash_after:
            raise RuntimeError("simulated preemption")
        return super().segment()


class _CrashesInEpoch3(_CrashesInEpoch2):
    crash_after = 2


class CrashAfterFirstEpoch(TrainingJob):
    """Dies as a preempted job would: after epoch 1 was checkpointed, before epoch 2 ends."""

    recipe = _CrashesInEpoch2


class CrashAfterSecondEpoch(TrainingJob):
    recipe = _CrashesInEpoch3


def _final_state(out_dir: Path) -> dict:
    path = latest_checkpoint(out_dir / "checkpoints")
    assert path is not None
    return load_state(path)


@pytest.mark.parametrize("keys", [{}, RECIPE], ids=["defaults", "recipe"])
def test_a_resumed_job_ends_exactly_where_an_uninterrupted_one_does(
    dataset: DatasetRef, tmp_path: Path, capsys: pytest.CaptureFixture[str], keys: dict[str, Any]
) -> None:
    TrainingJob(_spec(dataset, tmp_path / "straight", epochs=2, **keys))()
    interrupted = _spec(dataset, tmp_path / "resumed", epochs=2, **keys)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        CrashAfterFirstEpoch(interrupted)()
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints") is not None
    capsys.readouterr()
    ref = TrainingJob(interrupted)()
    assert "after epoch 1" in capsys.readouterr().out
    straight, resumed = _final_state(tmp_path / "straight"), _final_state(tmp_path / "resumed")
    assert resumed["epoch"] == 2 and resumed["step"] == straight["step"]
    for name, tensor in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, atol=1e-6, rtol=0)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
    learned = ("lr", "train_loss", "val_loss", "grad_norm")  # not the timings
    assert [{k: h.get(k) for k in learned} for h in resumed["history"]] == [
        {k: h.get(k) for k in learned} for h in straight["history"]
    ]
    assert ("grad_norm" in resumed["history"][1]) == bool(keys)
    assert ref is not None and json.loads(ref.history_path.read_text())[1]["epoch"] == 2


def test_a_truncated_newest_checkpoint_is_skipped_and_the_run_ends_where_it_would_have(
    dataset: DatasetRef, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    TrainingJob(_spec(dataset, tmp_path / "straight", epochs=3))()
    interrupted = _spec(dataset, tmp_path / "resumed", epochs=3)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        CrashAfterSecondEpoch(interrupted)()
    folder = tmp_path / "resumed" / "checkpoints"
    newest = folder / "epoch-000002.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a cut-off copy
    capsys.readouterr()
    TrainingJob(interrupted)()
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {newest} does not match its recorded sha256" in out
    assert f"resuming from {folder / 'epoch-000001.pt'} after epoch 1" in out
    straight, resumed = _final_state(tmp_path / "straight"), _final_state(tmp_path / "resumed")
    assert resumed["epoch"] == 3 and resumed["step"] == straight["step"]
    for name, tensor in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, atol=1e-6, rtol=0)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]


def test_a_job_with_more_epochs_continues_a_finished_run(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    first = TrainingJob(_spec(dataset, tmp_path, epochs=1))()
    second = TrainingJob(_spec(dataset, tmp_path, epochs=2))()
    assert first is not None and second is not None
    history = json.loads(second.history_path.read_text())
    assert [h["epoch"] for h in history] == [1, 2]
    assert history[0]["train_loss"] == json.loads(first.history_path.read_text())[0]["train_loss"]


def test_a_finished_job_run_again_trains_nothing_and_returns_the_same_best(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    first = TrainingJob(_spec(dataset, tmp_path, epochs=1))()
    again = TrainingJob(_spec(dataset, tmp_path, epochs=1))()
    assert first == again


@pytest.mark.services
def test_a_resumed_job_logs_every_epoch_to_mlflow_exactly_once(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    train = TrainConfig(epochs=3, batch_size=32, device="cpu", log_every_epochs=2)
    spec = TrainJobSpec(
        train=train, dataset=dataset, out_dir=tmp_path / "run", tracking_uri=uri, run_id=run_id
    )
    with pytest.raises(RuntimeError, match="simulated preemption"):
        CrashAfterFirstEpoch(spec)()  # epoch 1 was checkpointed, its metrics still buffered
    # The failing job drains its metric buffer (checkpointing.recorder): epoch 1 is not lost...
    Relay(spec.out_dir, uri, run_id, say=print).finish()  # the flow sends the journal
    assert [m.step for m in client.get_metric_history(run_id, "val_accuracy")] == [1]
    TrainingJob(spec)()  # ...and the resumed job, which starts at epoch 2, does not log it again
    Relay(spec.out_dir, uri, run_id, say=print).finish()  # a new flow: all of it, kept once
    steps = [m.step for m in client.get_metric_history(run_id, "val_accuracy")]
    assert sorted(steps) == [1, 2, 3]
    assert set(client.get_run(run_id).data.metrics) == {
        "train_loss",
        "train_accuracy",
        "val_loss",
        "val_accuracy",
        "samples_per_s",
        "epoch_time_s",
        "lr",
        # throughput over ranks and model FLOP utilisation (tasks.train.throughput)
        *(
            f"rank_{m}_{s}"
            for m in ("samples_per_s", "step_time_s")
            for s in ("min", "median", "max")
        ),
        "slowest_rank",
        # each rank's step time and its parts (tasks.train.limits.step_times): one rank here
        *(f"rank_{part}_s/rank_0" for part in ("step", "data_wait", "compute", "comm")),
        "achieved_flops_per_s",
        "model_flops_per_sample",
        "mfu",
        # the best weights' test pass as the job ends (tasks.train.first_result)
        "test_loss",
        "test_accuracy",
    }
    assert len(client.get_metric_history(run_id, "test_accuracy")) == 1  # the ending job's


def test_a_checkpoint_of_another_run_is_not_resumed(dataset: DatasetRef, tmp_path: Path) -> None:
    TrainingJob(_spec(dataset, tmp_path, epochs=1))()
    other = _spec(dataset, tmp_path, epochs=2).model_copy(
        update={"train": TrainConfig(model="resnet", width=4, epochs=2, device="cpu", seed=3)}
    )
    with pytest.raises(ConfigError, match=r"other settings \(batch_size, model, width\)"):
        TrainingJob(other)()


def test_a_checkpoint_written_before_model_plugins_still_resumes(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    """Such checkpoints recorded train.width=32 (then its default) and no model_args."""
    job = TrainingJob(_spec(dataset, tmp_path, epochs=1))
    saved = {k: v for k, v in job._run_identity().items() if k != "model_args"}
    job._check_same_run({**saved, "width": 32}, tmp_path / "old.pt")
    with pytest.raises(ConfigError, match=r"other settings \(width\)"):
        job._check_same_run({**saved, "width": 8}, tmp_path / "old.pt")


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_training_state_round_trips_under_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    random.seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _one_step(model, optimizer, torch.randn(4, 3))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    progress = {"epoch": 3, "step": 12, "history": [{"epoch": 1, "val_accuracy": 0.5}]}
    path = save_checkpoint(training_state(model, optimizer, scaler, progress), tmp_path)
    expected = torch.rand(3), random.random()
    torch.manual_seed(99)
    random.seed(99)

    state = load_state(path)
    restore_rng(state["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    copy = nn.Linear(3, 2)
    copy.load_state_dict(state["model"])
    assert torch.equal(copy.weight, model.weight)
    copy_optimizer = torch.optim.AdamW(copy.parameters(), lr=0.1)
    copy_optimizer.load_state_dict(state["optimizer"])
    x = torch.randn(4, 3)
    _one_step(model, optimizer, x)
    _one_step(copy, copy_optimizer, x)
    assert torch.equal(copy.weight, model.weight)  # Adam moments came back too
    assert state["scaler"]["scale"] == 256.0
    assert (state["epoch"], state["step"], state["history"]) == (3, 12, progress["history"])


def test_the_last_two_checkpoints_are_kept_each_with_its_sha256(tmp_path: Path) -> None:
    stale_tmp = tmp_path / "epoch-000009.pt.tmp-1234"
    tmp_path.mkdir(exist_ok=True)
    stale_tmp.write_bytes(b"half a file")
    assert latest_checkpoint(tmp_path) is None
    for epoch in (1, 2, 3):
        save_checkpoint({"epoch": epoch}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-000002.pt",
        "epoch-000002.pt.sha256",
        "epoch-000003.pt",
        "epoch-000003.pt.sha256",
    ]
    for name in ("epoch-000002.pt", "epoch-000003.pt"):
        recorded = (tmp_path / f"{name}.sha256").read_text()
        assert recorded == f"{sha256_file(tmp_path / name)}  {name}\n"  # sha256sum -c reads it
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch-000003.pt"
    assert latest_checkpoint(tmp_path / "missing") is None
    assert resumable_checkpoint(tmp_path / "missing") is None


def test_a_flipped_bit_in_the_newest_checkpoint_falls_back_to_the_one_before(
    tmp_path: Path,
) -> None:
    for epoch in (1, 2):
        save_checkpoint({"epoch": epoch, "w": torch.zeros(4096)}, tmp_path)
    newest = tmp_path / "epoch-000002.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor's bytes: torch.load would not notice
    newest.write_bytes(bytes(data))
    assert load_state(newest)["epoch"] == 2
    found = resumable_checkpoint(tmp_path)
    assert found is not None and found.path == tmp_path / "epoch-000001.pt"
    assert found.state["epoch"] == 1
    assert found.skipped == [
        f"{newest} does not match its recorded sha256 ({len(data)} bytes: truncated or corrupted)"
    ]


def test_when_no_checkpoint_verifies_resuming_is_refused_not_restarted(tmp_path: Path) -> None:
    for epoch in (1, 2):
        save_checkpoint({"epoch": epoch}, tmp_path)
    (tmp_path / "epoch-000001.pt").write_bytes(b"")
    (tmp_path / "epoch-000002.pt").write_bytes(b"")
    with pytest.raises(DataError, match=r"no checkpoint to resume from verifies: .*epoch-000002"):
        resumable_checkpoint(tmp_path)


def test_a_checkpoint_written_before_hashes_were_kept_still_resumes(tmp_path: Path) -> None:
    atomic_save({"epoch": 4}, tmp_path / "epoch-000004.pt")  # no .sha256 next to it
    found = resumable_checkpoint(tmp_path)
    assert found is not None and found.state == {"epoch": 4} and found.skipped == []


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> tuple:
            raise RuntimeError("disk full")

    path = tmp_path / "state.pt"
    atomic_save({"epoch": 1}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"epoch": 2, "bad": Unpicklable()}, path)
    assert load_state(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_best_model_file_holds_weights_and_meta_and_its_hash(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    path = tmp_path / "best.pt"
    save_best(model, path, {"epoch": 2, "metrics": {"val_accuracy": 0.75}})
    state = torch.load(path, weights_only=True)
    assert torch.equal(state["model"]["weight"], model.weight)
    assert state["meta"]["metrics"]["val_accuracy"] == 0.75
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
