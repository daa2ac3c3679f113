"""A pipeline stopped early by train.early_stop_patience: every run FINISHED, and evaluation
takes the best model by train.monitor (the tiny preset, 2 DDP ranks, ~40 s).

monitor_mode=max on val_loss ranks a learning run's first epoch best, so the monitor's best is
neither the newest epoch nor the objective's default (val_accuracy): the test finds it in the
train run's logged val_loss and compares best.pt, which evaluation loaded, with that epoch's
checkpoint, weight for weight.
"""

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from trainflow.flows.pipeline import pipeline

pytestmark = pytest.mark.integration


def test_an_early_stopped_pipeline_finishes_and_evaluates_the_monitors_best(
    tmp_path: Path,
) -> None:
    overrides = [
        f"workdir={tmp_path}",
        "train.epochs=6",
        "train.monitor=val_loss",
        "train.monitor_mode=max",
        "train.early_stop_patience=1",
    ]
    summary = pipeline(preset="tiny", overrides=overrides)

    client = MlflowClient(summary.tracking_uri)
    assert client.get_run(summary.parent_run_id).info.status == "FINISHED"
    exp = client.get_experiment_by_name(summary.experiment)
    assert exp is not None
    kids = {
        r.info.run_name: r
        for r in client.search_runs(
            [exp.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
        )
    }
    assert {name: r.info.status for name, r in kids.items()} == {
        "preprocess": "FINISHED",
        "train": "FINISHED",
        "evaluate": "FINISHED",
    }
    train_id = kids["train"].info.run_id
    logged = {m.step: m.value for m in client.get_metric_history(train_id, "val_loss")}
    assert 2 <= len(logged) < 6  # stopped early: once val_loss fell below its best (for max)
    best = max(logged, key=lambda epoch: (logged[epoch], -epoch))
    tags = client.get_run(train_id).data.tags
    assert tags["best_epoch"] == str(best)
    run_dir = tmp_path / "runs" / summary.parent_run_id
    log = "".join(p.read_text() for p in run_dir.glob("jobs/*_0_log.out"))
    assert f"early stop at epoch {len(logged)}: val_loss has not improved" in log
    chosen = torch.load(Path(tags["best_checkpoint"]), weights_only=True)["model"]
    that_epoch = torch.load(run_dir / "checkpoints" / f"epoch-{best:06d}.pt", weights_only=True)
    assert chosen.keys() == that_epoch["model"].keys()
    assert all(torch.equal(chosen[k], that_epoch["model"][k]) for k in chosen)
