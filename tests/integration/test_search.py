"""`trainflow sweep --space`: a search on the local executor, trials pulled by two array
tasks of two ranks each, losing trials pruned, the best evaluated and registered."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from tests.services import wait_for_line
from trainflow.flows import cli
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.study import OVER_BUDGET_ATTR, make_ref, open_study

pytestmark = pytest.mark.integration

GOOD, BAD = (0.005, 0.003, 0.004), (1e-07, 2e-07)
"""Learning rates that learn the tiny preset's data in 2 epochs, and that cannot (too small to
move the weights: chance accuracy after epoch 1; large ones still learn this easy data)."""


def test_a_search_prunes_losing_trials_and_registers_the_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    space = f"train.lr=choice({','.join(map(str, GOOD + BAD))})"
    # Known-good trials first (Optuna's enqueue_trial, as a user seeds a study): the median
    # rule then has complete trials to prune the bad ones against.
    cfg = SearchConfig(space={"train.lr": space.partition("=")[2]}, study="tiny-search")
    study = open_study(make_ref(cfg, tmp_path, "local", "tiny", "val_accuracy", True))
    for lr in (0.005, 0.003, 1e-07, 2e-07, 1e-07, 0.004):
        study.enqueue_trial({"train.lr": lr})
    argv = ["sweep", "--preset", "tiny", "--set", f"workdir={tmp_path}", "--space", space]
    argv += ["--trials", "6", "--parallel", "2", "--pruner", "median"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    study = open_study(make_ref(cfg, tmp_path, "local", "tiny", "val_accuracy", True))
    trials = [t for t in study.trials if not t.user_attrs.get(OVER_BUDGET_ATTR)]
    assert len(trials) == 6
    assert {t.params["train.lr"] for t in trials} == set(GOOD + BAD)
    bad = [t for t in trials if t.params["train.lr"] in BAD]
    good = [t for t in trials if t.params["train.lr"] in GOOD]
    assert all(t.state == TrialState.COMPLETE for t in good)
    pruned = [t for t in bad if t.state == TrialState.PRUNED]
    assert pruned, [(t.params, t.state, t.intermediate_values) for t in bad]
    assert all(list(t.intermediate_values) == [1] for t in pruned)  # stopped after epoch 1
    assert "== trials of study tiny-search ==" in out
    assert f"trial {pruned[0].number:>3}: pruned at epoch 1" in out
    best = max(good, key=lambda t: (t.value, -t.number))
    assert f"best: trial {best.number} {{'train.lr': {best.params['train.lr']}}}" in out
    parent_id = next(line.split()[-1] for line in out.splitlines() if "parent run id" in line)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(parent_id)
    assert parent.data.tags["best_trial"] == str(best.number)
    kids = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    by_name = {r.info.run_name: r for r in kids}
    assert sorted(by_name) == ["evaluate", "preprocess"] + [f"trial[{i}]" for i in range(6)]
    for trial in trials:
        run = by_name[f"trial[{trial.number}]"]
        assert run.info.status == "FINISHED"
        assert run.data.params["search.train.lr"] == str(trial.params["train.lr"])
        points = client.get_metric_history(run.info.run_id, "val_accuracy")
        if trial.state == TrialState.PRUNED:
            assert run.data.tags["trial_state"] == "pruned at epoch 1" and len(points) == 1
        else:
            assert run.data.tags["trial_state"] == "complete" and len(points) == 2
    assert "model version   reference_cnn-classification v1 (now the champion)" in out
    # Prefect's progress artifact ended at the whole budget, with the study's counts.
    done = f"{len(trials) - len(pruned)} complete, {len(pruned)} pruned, 0 failed"
    expected = f"search: {done}, 0 running of 6 trials; best val_accuracy {best.value:.4f} "
    expected += f"(trial {best.number})"
    found = ArtifactFilter(key=ArtifactFilterKey(any_=["search-progress"]))
    with get_client(sync_client=True) as prefect:
        shown = prefect.read_artifacts(artifact_filter=found, limit=50)
    assert [a for a in shown if a.description == expected and float(str(a.data)) == 100.0], [
        a.description for a in shown
    ]
    plots = {a.path for a in client.list_artifacts(parent_id, "plots")}
    for name in ("optimization_history", "intermediate_values", "param_importances"):
        assert f"plots/search_{name}.png" in plots
    version = client.get_model_version("reference_cnn-classification", "1")
    assert version.tags["config_hash"] == parent.data.tags["config_hash"]


def test_sigterm_cancels_the_array_and_leaves_no_trial_running(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    argv = [sys.executable, "-m", "trainflow.flows.cli", "sweep", "--preset", "tiny"]
    argv += ["--set", f"workdir={tmp_path}", "--set", "train.epochs=5000"]
    argv += ["--set", "cluster.ranks_per_node=1", "--space", "train.lr=loguniform(1e-3,1e-2)"]
    argv += ["--trials", "4", "--parallel", "2", "--pruner", "none"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        wait_for_line(proc, "epoch 2/5000", limit_s=300)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
    cfg = SearchConfig(space={"train.lr": "loguniform(1e-3,1e-2)"}, study="tiny-search")
    trials = open_study(make_ref(cfg, tmp_path, "local", "tiny", "val_accuracy", True)).trials
    assert trials and not [t for t in trials if t.state == TrialState.RUNNING]
    assert [t for t in trials if t.state == TrialState.FAIL and t.intermediate_values]
    time.sleep(2)  # no task or rank of the search survives
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
    assert not list((tmp_path / "active_jobs").glob("*.json"))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert runs["tiny-search"].info.status == "KILLED"
    for trial in trials:
        run = runs[f"trial[{trial.number}]"]
        assert run.info.status == "KILLED", (trial.number, run.data.tags)
        assert run.data.tags["trial_state"] == "killed (cancelled)"
