"""A full disk is one line naming the stage, path and space; concurrent starts on a new store.

The full disk is a real, small tmpfs mounted under the test's folder (needs root: skipped
otherwise); the concurrent starts are real processes released at the same moment.
"""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.services import wait_for
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.diskspace import DiskFullError, disk_stage
from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec

ROOT = Path(__file__).resolve().parents[2]


def _tmpfs(folder: Path, size: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: too small for an MLflow store (~1 MiB) or a checkpoint (~160 KiB)."""
    yield from _tmpfs(tmp_path / "small", "64k")


def test_a_full_disk_at_the_tracking_store_is_one_line(small_disk: Path) -> None:
    workdir = small_disk / "wd"
    with pytest.raises(DiskFullError) as err:
        PipelineRuns(TrackingConfig(), workdir, "p")
    message = str(err.value)
    assert message.startswith(f"tracking store: no space left on the disk of {workdir} (")
    assert "about 2.0 MiB needed" in message and "\n" not in message


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
