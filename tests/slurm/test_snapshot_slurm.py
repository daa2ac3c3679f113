"""The code that runs is the code that was submitted, on the 2-node Slurm.

The user's model module is edited while the training job waits in the queue (held behind a
job that takes both nodes), and again while it runs, just before it is requeued. The ranks'
PYTHONPATH holds the edited project folder, so without the snapshot they would build the edited
network; the trained weights have the submitted network's shape, on both attempts (a requeued
attempt building another shape could not even load its checkpoint).
"""

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gates import GatedJob
from tests.slurm.test_requeue import _wait_for_new_attempt
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.cluster.snapshot import snapshot_for_jobs
from trainflow.tasks.train.checkpointing.checkpoint import load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef

_MODULE = """\
import math
from torch import nn

HIDDEN = {hidden}


def build(spec):
    width = math.prod(spec.sample_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(width, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, spec.num_classes))
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "project"
    root.mkdir()
    (root / "queued_models.py").write_text(_MODULE.format(hidden=5))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))  # sbatch exports it to the ranks
    yield root
    sys.modules.pop("queued_models", None)


def _squeue_state(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


def _wait(what: str, done: object, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.mark.timeout(600)
def test_a_queued_and_requeued_job_trains_the_submitted_code(project: Path, tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "data", n_train=512, n_val=64)
    code = snapshot_for_jobs(["queued_models"], tmp_path / "jobs")
    assert code is not None
    spec = TrainJobSpec(
        train=TrainConfig(model="queued_models:build", epochs=3, batch_size=64),
        dataset=dataset,
        out_dir=tmp_path / "run",
        code=code.paths,
    )
    hold = ["sbatch", "--parsable", "-N", "2", "--exclusive", "-o", "/dev/null"]
    blocker = subprocess.run(
        [*hold, "--wrap", "sleep 600"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    try:
        _wait("the blocker to run", lambda: _squeue_state(blocker) == "RUNNING")
        gate = tmp_path / "gate-2"
        cluster = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=1)
        job = make_executor(cluster, tmp_path / "jobs").submit(GatedJob(spec, {2: gate}))
        job_id = str(job.job_id)
        assert _squeue_state(job_id) == "PENDING"
        (project / "queued_models.py").write_text(_MODULE.format(hidden=9))  # edited in queue
    finally:
        subprocess.run(["scancel", blocker], check=True, timeout=30)

    _wait("epoch 1's checkpoint", lambda: any((tmp_path / "run" / "checkpoints").glob("*.pt")))
    (project / "queued_models.py").write_text(_MODULE.format(hidden=13))  # edited again
    requeued_at = time.time()
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    _wait_for_new_attempt(job.paths.folder / f"{job_id}_0_rank.json", requeued_at)
    gate.touch()
    lines: list[str] = []
    ref = wait_for_job(job, lines.append)

    assert isinstance(ref, CheckpointRef)
    assert any("resuming from" in line for line in lines), "no requeue happened"
    assert any(line.startswith("[rank1@tfnode2] ") for line in lines)
    weights = load_state(ref.path)["model"]
    assert weights["1.weight"].shape == (5, 144)  # the submitted HIDDEN, not 9 or 13
