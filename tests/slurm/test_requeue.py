"""A job that hits its time limit checkpoints, is requeued and resumes: same result as without.

Slurm signals SIGUSR2 `signal_delay_s` before the 1-minute limit (it checks limits every
~30 s); submitit calls TrainingJob.checkpoint and requeues; the new attempt resumes from the
last per-epoch checkpoint and keeps logging into the same MLflow run.
"""

import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from cluster.config import ClusterConfig
from cluster.executor import make_executor
from cluster.jobs import wait_for_job
from tasks.tracking.config import TrackingConfig
from tasks.tracking.pipeline_runs import PipelineRuns
from tasks.train.checkpoint import latest_checkpoint, load_state
from tasks.train.config import TrainConfig
from tasks.train.job import TrainingJob, TrainJobSpec
from tasks.train.ref import CheckpointRef
from tests.unit.datasets import write_dataset

EPOCHS = 30  # ~1.3 s each: longer than an attempt runs before its signal (5-35 s in)
_NOT_COMPARED = {"samples_per_s", "epoch_time_s"}


def _train(spec: TrainJobSpec, cluster: ClusterConfig, folder: Path) -> list[str]:
    lines: list[str] = []
    job = make_executor(cluster, folder).submit(TrainingJob(spec))
    ref = wait_for_job(job, lines.append)
    assert isinstance(ref, CheckpointRef)
    return lines


def _latest(out_dir: Path) -> Path:
    path = latest_checkpoint(out_dir / "checkpoints")
    assert path is not None
    return path


def _final_state(out_dir: Path) -> dict[str, torch.Tensor]:
    return dict(load_state(_latest(out_dir))["model"])


def _comparable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in h.items() if k not in _NOT_COMPARED} for h in history]


@pytest.mark.timeout(600)
def test_requeued_job_resumes_and_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "data", n_train=32768, n_val=256)
    train = TrainConfig(epochs=EPOCHS, batch_size=64, precision="fp32", lr=1e-3)
    runs = PipelineRuns(TrackingConfig(experiment="requeue"), tmp_path, "requeue")
    run_id = runs.open_stage("train", {})
    spec = TrainJobSpec(
        train=train,
        dataset=dataset,
        out_dir=tmp_path / "slurm",
        tracking_uri=runs.tracking_uri,
        run_id=run_id,
    )
    # On a loaded machine an attempt may finish few epochs before its signal: allow many.
    slurm = ClusterConfig(
        executor="slurm", ranks_per_node=2, timeout_min=1, signal_delay_s=55, max_requeues=30
    )
    lines = _train(spec, slurm, tmp_path / "jobs-slurm")
    assert any("resuming from" in line for line in lines), "no requeue happened"

    reference = spec.model_copy(update={"out_dir": tmp_path / "local", "run_id": None})
    _train(reference, ClusterConfig(ranks_per_node=2), tmp_path / "jobs-local")

    requeued, plain = _final_state(tmp_path / "slurm"), _final_state(tmp_path / "local")
    assert requeued.keys() == plain.keys()
    for name, tensor in plain.items():
        torch.testing.assert_close(requeued[name], tensor, rtol=0, atol=1e-6, msg=name)
    state_r = load_state(_latest(tmp_path / "slurm"))
    state_p = load_state(_latest(tmp_path / "local"))
    assert (state_r["epoch"], state_r["step"]) == (state_p["epoch"], state_p["step"])
    for got, want in zip(
        _comparable(state_r["history"]), _comparable(state_p["history"]), strict=True
    ):
        assert got == pytest.approx(want, abs=1e-6)

    # One MLflow run, every epoch logged exactly once.
    client = MlflowClient(runs.tracking_uri)
    steps = [m.step for m in client.get_metric_history(run_id, "val_accuracy")]
    assert sorted(steps) == list(range(1, EPOCHS + 1))
    exp = client.get_experiment_by_name("requeue")
    assert exp is not None
    assert len(client.search_runs([exp.experiment_id])) == 2  # the parent and this train run


def test_scontrol_requeue_resumes_into_the_same_mlflow_run(tmp_path: Path) -> None:
    # Preemption with PreemptMode=REQUEUE looks like this to the job: killed, queued again.
    dataset = write_dataset(tmp_path / "data", n_train=8192, n_val=256)
    epochs = 60
    runs = PipelineRuns(TrackingConfig(experiment="requeue"), tmp_path, "requeue")
    run_id = runs.open_stage("train", {})
    spec = TrainJobSpec(
        train=TrainConfig(epochs=epochs, batch_size=64, precision="fp32"),
        dataset=dataset,
        out_dir=tmp_path / "run",
        tracking_uri=runs.tracking_uri,
        run_id=run_id,
    )
    cluster = ClusterConfig(executor="slurm", ranks_per_node=2)
    job = make_executor(cluster, tmp_path / "jobs").submit(TrainingJob(spec))
    log = Path(job.task(0).paths.stdout)
    deadline = time.monotonic() + 120
    while not (log.exists() and "epoch 5/" in log.read_text()):
        assert time.monotonic() < deadline, "the job never reached epoch 5"
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", str(job.job_id)], check=True, timeout=30)
    lines: list[str] = []
    ref = wait_for_job(job, lines.append)
    assert isinstance(ref, CheckpointRef)
    assert any("resuming from" in line for line in lines)
    history = load_state(_latest(tmp_path / "run"))["history"]
    assert [int(h["epoch"]) for h in history] == list(range(1, epochs + 1))
    steps = [
        m.step for m in MlflowClient(runs.tracking_uri).get_metric_history(run_id, "train_loss")
    ]
    assert sorted(steps) == list(range(1, epochs + 1))
