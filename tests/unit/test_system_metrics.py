"""System metrics per node through MLflow's own monitor, against a real SQLite store."""

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.tasks.tracking.system_metrics import job_gpus, node_monitor, node_name


def test_node_is_named_by_slurm_else_by_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    assert node_name() == "n2"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert node_name()


def test_job_gpus_come_from_slurm_first() -> None:
    both = {"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}
    assert job_gpus(both) == ["2", "3"]
    assert job_gpus({"CUDA_VISIBLE_DEVICES": "GPU-ab,GPU-cd"}) == ["GPU-ab", "GPU-cd"]
    assert job_gpus({"SLURM_JOB_GPUS": "NoDevFiles"}) is None
    assert job_gpus({}) is None


def test_monitor_logs_under_the_node_name_while_the_block_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp).info.run_id
    key = "system/n7/cpu_utilization_percentage"
    with node_monitor(uri, run_id, local_rank=0, interval_s=0.2) as node:
        assert node == "n7"
        deadline = time.monotonic() + 60
        while key not in client.get_run(run_id).data.metrics and time.monotonic() < deadline:
            time.sleep(0.2)
    metrics = client.get_run(run_id).data.metrics
    assert key in metrics and "system/n7/system_memory_usage_percentage" in metrics
    # Other local ranks, and runs without a tracking run, start nothing.
    with node_monitor(uri, run_id, local_rank=1, interval_s=0.2) as other:
        assert other is None
    with node_monitor(None, None, local_rank=0, interval_s=0.2) as none:
        assert none is None


def test_an_unreachable_server_does_not_hold_up_the_block() -> None:
    with node_monitor("http://127.0.0.1:9", "r" * 32, local_rank=0, interval_s=0.2) as node:
        assert node
