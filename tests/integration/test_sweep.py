"""A sweep: one dataset, a grid trained as one array of jobs, the best element evaluated."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.flows.sweep import sweep

pytestmark = pytest.mark.integration


def test_sweep_trains_each_element_and_evaluates_the_best(tmp_path: Path) -> None:
    # lr 1e-6 cannot learn in 2 epochs; lr 5e-3 does: the best element is known.
    grid = {"train.lr": [1e-6, 5e-3]}
    summary = sweep(
        preset="tiny", overrides=[f"workdir={tmp_path}", "cluster.ranks_per_node=1"], grid=grid
    )
    assert summary.best_overrides == {"train.lr": 5e-3}
    assert len(summary.val_accuracy) == 2
    low, high = summary.val_accuracy
    assert low is not None and high is not None and high > low
    client = MlflowClient(summary.tracking_uri)
    parent = client.get_run(summary.parent_run_id)
    assert json.loads(parent.data.tags["best_element"]) == {"train.lr": 5e-3}
    exp = client.get_experiment_by_name(summary.experiment)
    assert exp is not None
    kids = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
    )
    names = sorted(r.info.run_name for r in kids)
    assert names == ["evaluate", "preprocess", "train[0]", "train[1]"]
    assert all(r.info.status == "FINISHED" for r in kids)
    train1 = next(r for r in kids if r.info.run_name == "train[1]")
    assert len(client.get_metric_history(train1.info.run_id, "val_accuracy")) == 2
    # The best element's model is registered, tagged like the parent run, and (first in this
    # store) takes the champion alias.
    assert summary.model_version == "1" and summary.champion
    version = client.get_model_version(summary.registered_model or "", "1")
    assert version.tags["config_hash"] == parent.data.tags["config_hash"]
