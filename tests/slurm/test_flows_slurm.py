"""Flows on Slurm: requests checked before any work; a sweep is one job array (its
preprocessing on dask workers that are Slurm jobs)."""

import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.errors import ConfigError, JobError
from trainflow.flows.pipeline import pipeline
from trainflow.flows.sweep import sweep


def test_sweep_is_one_slurm_job_array_spread_over_both_nodes(tmp_path: Path) -> None:
    """The array's two elements run on tfnode1 and tfnode2, as each train run's tags say.

    Each element asks for 3 CPUs (cluster.cpus_per_task=3) and a dev node has 4, so one node
    cannot hold both elements at once: queued together while both nodes are free, they start
    on different nodes (a tiny element alone would fit twice on one node, and Slurm would
    pack both there). Preprocessing's dask workers are Slurm jobs too
    (cluster.dask.executor=slurm): 1 CPU each, so a worker still being cancelled leaves room.
    """
    overrides = [f"workdir={tmp_path}", "cluster.executor=slurm", "cluster.ranks_per_node=1"]
    overrides += ["cluster.cpus_per_task=3"]
    overrides += ["cluster.dask.executor=slurm", "cluster.dask.mem_gb=0.5"]
    summary = sweep(preset="tiny", overrides=overrides, grid={"train.lr": [1e-6, 5e-3]})
    worker_logs = sorted((tmp_path / "dask-workers").glob("trainflow-dask-*.err"))
    assert len(worker_logs) == 2  # the default cluster.dask.n_workers, one job each
    assert not list((tmp_path / "active_jobs").glob("*.json"))  # every job forgotten
    assert summary.best_overrides == {"train.lr": 5e-3}
    logs = sorted((tmp_path / "runs" / summary.parent_run_id / "jobs").glob("*_log.out"))
    # Array tasks are named <array id>_<index>_<task>: one array id, indices 0 and 1.
    names = [re.fullmatch(r"(\d+)_(\d+)_0_log\.out", p.name) for p in logs]
    assert all(names) and len(names) == 2
    assert len({m.group(1) for m in names if m}) == 1
    assert sorted(m.group(2) for m in names if m) == ["0", "1"]
    client = MlflowClient(summary.tracking_uri)
    exp = client.get_experiment_by_name(summary.experiment)
    assert exp is not None
    kids = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
    )
    assert sorted(r.info.run_name for r in kids) == [
        "evaluate",
        "preprocess",
        "train[0]",
        "train[1]",
    ]
    trains = [run for run in kids if run.info.run_name.startswith("train[")]
    for run in trains:
        assert run.data.tags["slurm_state"] == "COMPLETED"
        assert run.data.metrics["slurm_cpu_hours"] > 0
    assert sorted(run.data.tags["slurm_node_list"] for run in trains) == ["tfnode1", "tfnode2"]


def test_impossible_slurm_request_fails_before_any_work(tmp_path: Path) -> None:
    overrides = [f"workdir={tmp_path}", "cluster.executor=slurm", "cluster.cpus_per_task=64"]
    with pytest.raises(ConfigError, match="cpus_per_task"):
        pipeline(preset="tiny", overrides=overrides)
    assert not (tmp_path / "datasets").exists()
    assert not (tmp_path / "mlflow.db").exists()


def test_remote_failure_fails_task_with_traceback_and_mlflow_runs(tmp_path: Path) -> None:
    # The submitting host may lack GPUs that nodes have, so device=cuda is only refused in the
    # job itself: a genuine remote failure.
    overrides = [f"workdir={tmp_path}", "cluster.executor=slurm", "train.device=cuda"]
    raised = r"failed in rank .* raised ConfigError: train\.device"
    with pytest.raises(JobError, match=raised) as err:
        pipeline(preset="tiny", overrides=overrides)
    assert "Traceback" in err.value.detail
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert {k: r.info.status for k, r in runs.items()} == {
        "tiny": "FAILED",
        "preprocess": "FINISHED",
        "train": "FAILED",
    }
    assert runs["train"].data.tags["slurm_state"] == "FAILED"
