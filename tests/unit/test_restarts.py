"""A job that loses a rank is restarted from its last checkpoint (cluster.max_restarts).

Real local jobs of two gloo ranks; rank 1 is killed with SIGKILL after epoch 2. With a restart
left the job resumes in the same MLflow run and ends with the uninterrupted run's weights;
without one it fails, naming the lost rank.
"""

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.lost_ranks import RankLostError
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.task import train_with_restarts

pytestmark = pytest.mark.timeout(240)
EPOCHS = 60  # ~0.1 s each here: the kill after epoch 2 must land long before the end


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _run(tmp_path: Path, name: str) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("r") or client.get_experiment(
        client.create_experiment("r", artifact_location=(tmp_path / "art").as_uri())
    )
    return client, str(client.create_run(exp.experiment_id, run_name=name).info.run_id)


def _spec(dataset: DatasetRef, out: Path, run: tuple[MlflowClient, str]) -> TrainJobSpec:
    train = TrainConfig(epochs=EPOCHS, batch_size=32, device="cpu", precision="fp32")
    uri = run[0].tracking_uri
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out, tracking_uri=uri, run_id=run[1])


def _killer(job_dir: Path, times: int) -> tuple[Callable[[str], None], list[int]]:
    """A log callback that SIGKILLs rank 1 when rank 0 reports epoch 2, in `times` attempts."""
    killed: list[int] = []

    def on_line(line: str) -> None:
        if len(killed) < times and f"epoch 2/{EPOCHS}" in line:
            newest = max(job_dir.glob("*_1_rank.json"), key=lambda p: p.stat().st_mtime)
            pid = int(json.loads(newest.read_text())["pid"])
            if pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    return on_line, killed


@pytest.mark.services
def test_a_lost_rank_restarts_from_the_checkpoint_in_the_same_run_to_the_same_weights(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    cfg = ClusterConfig(ranks_per_node=2, timeout_min=10, max_restarts=1)
    plain_run, lost_run = _run(tmp_path, "plain"), _run(tmp_path, "lost")
    plain = train_with_restarts(
        _spec(dataset, tmp_path / "plain", plain_run), cfg, tmp_path / "j0", tmp_path, print, print
    )
    on_line, killed = _killer(tmp_path / "j1", times=1)
    warnings: list[str] = []
    ref = train_with_restarts(
        _spec(dataset, tmp_path / "lost", lost_run),
        cfg,
        tmp_path / "j1",
        tmp_path,
        on_line,
        warnings.append,
    )

    assert killed and isinstance(ref, CheckpointRef) and isinstance(plain, CheckpointRef)
    named = [w for w in warnings if "lost rank 1" in w and "killed by signal 9 (SIGKILL)" in w]
    assert named, warnings
    a = torch.load(ref.path, weights_only=True)["model"]
    b = torch.load(plain.path, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted run's weights differ"
    client, run_id = lost_run
    tags = client.get_run(run_id).data.tags
    assert "lost rank 1" in tags["lost_ranks.0"] and tags["lost_nodes"]
    steps = {m.step for m in client.get_metric_history(run_id, "val_accuracy")}
    assert steps == set(range(1, EPOCHS + 1))  # one run, continued, every epoch in it


@pytest.mark.services
def test_with_no_restart_left_the_lost_rank_fails_the_job(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    cfg = ClusterConfig(ranks_per_node=2, timeout_min=10, max_restarts=0)
    on_line, killed = _killer(tmp_path / "j", times=1)
    run = _run(tmp_path, "lost")
    with pytest.raises(RankLostError) as failure:
        train_with_restarts(
            _spec(dataset, tmp_path / "out", run), cfg, tmp_path / "j", tmp_path, on_line, print
        )
    assert killed
    message = str(failure.value)
    assert message.splitlines()[0].startswith("job ") and "lost rank 1" in message
    assert "no restart left (cluster.max_restarts=0)" in message
