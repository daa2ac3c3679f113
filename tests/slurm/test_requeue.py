"""A job told to checkpoint is requeued and resumes: same result as without.

Before a time limit (or a preemption) Slurm signals SIGUSR2; submitit calls
TrainingJob.checkpoint and requeues; the new attempt resumes from the last per-epoch checkpoint
and keeps logging into the same MLflow run. The tests send that signal themselves when the log
shows a chosen epoch (`scancel --signal=USR2`), so they hold on a busy machine, where a
1-minute limit may pass before an epoch does.
"""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.gates import GatedJob
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.tracking.relay import relaying
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint, load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

EPOCHS = 8
_TIMED = ("samples_per_s", "step_time_s")  # wall-clock figures: never equal across two runs
_NOT_COMPARED = {
    "samples_per_s",
    "epoch_time_s",
    *(f"rank_{m}_{s}" for m in _TIMED for s in ("min", "median", "max")),
    "slowest_rank",
    "achieved_flops_per_s",
    "mfu",
}


def _train(
    spec: TrainJobSpec, cluster: ClusterConfig, folder: Path, signal_at: str | None = None
) -> list[str]:
    """Train; with `signal_at`, send the job SIGUSR2 once a forwarded line contains it."""
    lines: list[str] = []
    job = make_executor(cluster, folder).submit(TrainingJob(spec))

    def on_line(line: str) -> None:
        lines.append(line)
        if signal_at and signal_at in line and not any("resuming from" in ln for ln in lines):
            # Every task of the job's steps, on both nodes, as Slurm does before a limit.
            subprocess.run(["scancel", "--signal=USR2", str(job.job_id)], check=True, timeout=30)

    with relaying(spec.out_dir, spec.tracking_uri, spec.run_id, lines.append):  # as the flow
        ref = wait_for_job(job, on_line)
    assert isinstance(ref, CheckpointRef)
    return lines


def _latest(out_dir: Path) -> Path:
    path = latest_checkpoint(out_dir / "checkpoints")
    assert path is not None
    return path


def _final_state(out_dir: Path) -> dict[str, torch.Tensor]:
    return dict(load_state(_latest(out_dir))["model"])


def _comparable(history: list[dict[str, float]]) -> list[dict[str, float]]:
    # Each rank's step time and its parts (rank_step_s/rank_0 ...) are wall-clock too.
    return [
        {k: v for k, v in h.items() if k not in _NOT_COMPARED and "_s/rank_" not in k}
        for h in history
    ]


@pytest.mark.timeout(600)
def test_a_two_node_job_requeued_mid_epoch_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "data", n_train=4096, n_val=256)
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
    slurm = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=1, timeout_min=30)
    lines = _train(spec, slurm, tmp_path / "jobs-slurm", signal_at=f"epoch 3/{EPOCHS}")
    assert any("resuming from" in line for line in lines), "no requeue happened"
    assert any(line.startswith("[rank1@tfnode2] ") for line in lines)
    (rank0_log,) = (tmp_path / "jobs-slurm").glob("*_0_log.out")  # both attempts', appended
    assert "scontrol shielded from SIGTERM" in rank0_log.read_text()  # cluster.requeue's

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


def _wait_for_new_attempt(rank_record: Path, since: float) -> None:
    """Wait until rank 0 of a new attempt has started (cluster.rank_guard's record)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            if json.loads(rank_record.read_text())["started"] > since:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, "the requeued job never started again"
        time.sleep(0.2)


def test_scontrol_requeue_resumes_into_the_same_mlflow_run(tmp_path: Path) -> None:
    # Preemption with PreemptMode=REQUEUE looks like this to the job: killed, queued again.
    # The job waits before epoch 6 until the requeue is under way, so it cannot finish first.
    dataset = write_dataset(tmp_path / "data", n_train=4096, n_val=256)
    epochs = EPOCHS
    gate = tmp_path / "gate-6"
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
    job = make_executor(cluster, tmp_path / "jobs").submit(GatedJob(spec, {6: gate}))
    log = Path(job.task(0).paths.stdout)
    deadline = time.monotonic() + 120
    while not (log.exists() and "epoch 5/" in log.read_text()):
        assert time.monotonic() < deadline, "the job never reached epoch 5"
        time.sleep(0.5)
    requeued_at = time.time()
    subprocess.run(["scontrol", "requeue", str(job.job_id)], check=True, timeout=30)
    _wait_for_new_attempt(job.paths.folder / f"{job.job_id}_0_rank.json", requeued_at)
    gate.touch()
    lines: list[str] = []
    with relaying(spec.out_dir, spec.tracking_uri, spec.run_id, lines.append):  # as the flow
        ref = wait_for_job(job, lines.append)
    assert isinstance(ref, CheckpointRef)
    assert any("resuming from" in line for line in lines)
    history = load_state(_latest(tmp_path / "run"))["history"]
    assert [int(h["epoch"]) for h in history] == list(range(1, epochs + 1))
    steps = [
        m.step for m in MlflowClient(runs.tracking_uri).get_metric_history(run_id, "train_loss")
    ]
    assert sorted(steps) == list(range(1, epochs + 1))
