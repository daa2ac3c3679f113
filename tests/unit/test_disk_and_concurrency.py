"""A full disk is one line naming the stage, path and space; concurrent starts on a new store.

The full disk is a real, small tmpfs mounted under the test's folder (needs root: skipped
otherwise); the concurrent starts are real processes released at the same moment.
"""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.disks import tmpfs
from tests.services import wait_for
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.diskspace import DiskFullError, disk_stage
from trainflow.tasks.evaluate.config import EvaluateConfig
from trainflow.tasks.evaluate.task import evaluate_task
from trainflow.tasks.preprocess.ref import dataset_spec
from trainflow.tasks.preprocess.writer import stage
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.model_plugins import check_model
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.task import train_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: too small for an MLflow store (~1 MiB) or a checkpoint (~160 KiB)."""
    yield from tmpfs(tmp_path / "small", "64k")


def test_a_full_disk_at_the_tracking_store_is_one_line(small_disk: Path) -> None:
    workdir = small_disk / "wd"
    with pytest.raises(DiskFullError) as err:
        PipelineRuns(TrackingConfig(), workdir, "p")
    message = str(err.value)
    assert message.startswith(f"tracking store: no space left on the disk of {workdir} (")
    assert "about 2.0 MiB needed" in message and "\n" not in message


@pytest.mark.services
def test_a_full_disk_in_a_training_rank_is_one_line(small_disk: Path, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds")
    spec = TrainJobSpec(
        train=TrainConfig(epochs=2, batch_size=32, device="cpu"),
        dataset=dataset,
        out_dir=small_disk / "run",
    )
    executor = make_executor(ClusterConfig(ranks_per_node=1, timeout_min=5), tmp_path / "jobs")
    job = executor.submit(TrainingJob(spec))
    with pytest.raises(DiskFullError) as err, disk_stage("train", spec.out_dir, 5 << 20):
        wait_for_job(job, lambda line: None, poll_s=0.2)
    message = str(err.value)
    assert message.startswith(f"train: no space left on the disk of {spec.out_dir} (")
    assert "about 5.0 MiB needed" in message and "\n" not in message


@pytest.fixture
def three_mib_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: a disk that fills up in the middle of a write (numpy's short write)."""
    yield from tmpfs(tmp_path / "three", "3m")


@pytest.fixture
def one_mib_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs."""
    yield from tmpfs(tmp_path / "one", "1m")


def test_a_short_write_without_errno_is_the_disk_full_line(three_mib_disk: Path) -> None:
    # numpy's np.save stops at a full disk with "3920000 requested and 3145600 written", no
    # errno: MNIST's staged pixels (tasks.preprocess.writer.stage) on a 3 MiB disk.
    folder = three_mib_disk
    images = np.zeros((5000, 1, 28, 28), np.uint8)
    with pytest.raises(DiskFullError) as err, disk_stage("preprocess", folder, 7_880_000):
        stage(images, folder)
    assert "requested and" in str(err.value.__cause__) and err.value.__cause__.errno is None  # type: ignore[union-attr]
    message = str(err.value)
    assert message.startswith(f"preprocess: no space left on the disk of {folder} (")
    assert "about 7.5 MiB needed" in message and "\n" not in message


def test_training_refuses_a_disk_too_small_for_its_checkpoints(
    small_disk: Path, tmp_path: Path
) -> None:
    dataset = write_dataset(tmp_path / "ds")
    spec = TrainJobSpec(
        train=TrainConfig(device="cpu"), dataset=dataset, out_dir=small_disk / "run"
    )
    jobs = tmp_path / "jobs"
    with pytest.raises(DiskFullError) as err:
        model = check_model(spec.train, dataset_spec(dataset, "classification"))
        train_task.fn(spec, ClusterConfig(ranks_per_node=1), jobs, tmp_path / "wd", model)
    message = str(err.value)
    assert message.startswith(f"train: not enough space on the disk of {spec.out_dir} (")
    assert "needed): free some space there" in message and "\n" not in message
    assert not any(small_disk.iterdir()) and not jobs.exists()  # refused before the job


def test_evaluation_refuses_a_disk_too_small_for_the_model_it_logs(
    one_mib_disk: Path, tmp_path: Path
) -> None:
    disk = one_mib_disk
    weights = disk / "best.pt"
    weights.write_bytes(b"w" * (600 << 10))  # the best weights: 600 KiB, the model as much again
    ckpt = CheckpointRef(
        path=weights, sha256="-", epoch=1, step=1, metrics={}, history_path=disk / "history.json"
    )
    dataset = write_dataset(tmp_path / "ds")
    with pytest.raises(DiskFullError) as err:
        evaluate_task.fn(EvaluateConfig(), TrainConfig(), dataset, ckpt, "sqlite:///x.db", "r", {})
    message = str(err.value)
    assert message.startswith(f"evaluate: not enough space on the disk of {disk} (")
    assert "about 1.2 MiB needed" in message
    assert [p.name for p in disk.iterdir()] == ["best.pt"]  # nothing written


_START = """
import sys, time
from pathlib import Path
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
go = Path(sys.argv[2])
Path(sys.argv[3]).touch()  # ready: MLflow imported
while not go.exists():
    time.sleep(0.005)
print(PipelineRuns(TrackingConfig(), Path(sys.argv[1]), "p").parent_id)
"""


@pytest.mark.services
def test_three_starts_at_once_on_a_new_working_folder_all_get_their_runs(tmp_path: Path) -> None:
    workdir, go = tmp_path / "wd", tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    ready = [tmp_path / f"ready-{i}" for i in range(3)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _START, str(workdir), str(go), str(flag)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for flag in ready
    ]
    # Released together once all three have imported MLflow.
    wait_for(lambda: all(flag.exists() for flag in ready), 300, "the three processes")
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, errout) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, errout.decode()[-2000:]
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("trainflow")
    assert exp is not None
    ids = {r.info.run_id for r in client.search_runs([exp.experiment_id])}
    assert ids == {out.decode().strip() for out, _ in outs}
