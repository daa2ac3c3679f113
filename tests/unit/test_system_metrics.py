"""System metrics per node: sampled into the job's journal, sent by the relay to a real SQLite
store."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.tasks.tracking.journal import count_records
from trainflow.tasks.tracking.relay import Relay
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


@pytest.mark.services
def test_sampler_journals_under_the_node_name_while_the_block_runs_and_relays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri())
    run_id = client.create_run(exp).info.run_id
    out = tmp_path / "out"
    journal = out / "tracking" / "node-n7.jsonl"
    with node_monitor(out, local_rank=0, interval_s=0.2) as node:
        assert node == "n7"
        deadline = time.monotonic() + 60
        while count_records(journal) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    samples = count_records(journal)
    assert samples >= 3  # two in the block at least, and the closing one
    Relay(out, uri, run_id, say=print).finish()
    history = client.get_metric_history(run_id, "system/n7/cpu_utilization_percentage")
    assert sorted(m.step for m in history) == list(range(samples))
    metrics = client.get_run(run_id).data.metrics
    assert 0 <= metrics["system/n7/system_memory_usage_percentage"] <= 100
    assert "system/n7/disk_available_megabytes" in metrics
    # A requeued job's sampler continues the steps.
    with node_monitor(out, local_rank=0, interval_s=60):
        pass
    assert count_records(journal) == samples + 1
    # Other local ranks, and jobs without a run, start nothing.
    with node_monitor(out, local_rank=1, interval_s=0.2) as other:
        assert other is None
    with node_monitor(None, local_rank=0, interval_s=0.2) as none:
        assert none is None


@pytest.mark.services
def test_a_rank_imports_samples_and_logs_without_mlflow(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "import trainflow.tasks.train.job, trainflow.tasks.train.sweep  # a rank's entry\n"
        "from trainflow.tasks.tracking.system_metrics import node_monitor\n"
        "from trainflow.tasks.tracking.logger import make_logger\n"
        "from trainflow.tasks.tracking.journal import Journal\n"
        f"out = Path({str(tmp_path)!r})\n"
        "with node_monitor(out, 0, 0.1):\n"
        "    logger = make_logger(Journal(out, 'rank0'))\n"
        "    logger.log({'x': 1.0}, 1); logger.close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert count_records(tmp_path / "tracking" / "rank0.jsonl") == 1
