"""Training across the dev cluster's two nodes: DDP over nodes, a rank lost on one node, and a
restart that avoids the lost node.

Jobs go through sbatch/srun on tfnode1 and tfnode2 (tests/slurm/conftest.py starts 2 nodes);
the ranks rendezvous at the job's first node by name (the hosts line the cluster writes).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest
import submitit
import torch

from cluster.config import ClusterConfig
from cluster.executor import make_executor
from cluster.jobs import wait_for_job
from tasks.errors import JobError
from tasks.preprocess.ref import DatasetRef
from tasks.train.config import TrainConfig
from tasks.train.job import TrainingJob, TrainJobSpec
from tasks.train.ref import CheckpointRef
from tasks.train.task import train_with_restarts
from tests.unit.datasets import write_dataset

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _spec(dataset: DatasetRef, out: Path, epochs: int) -> TrainJobSpec:
    # Global batch 32 whatever the layout: 2 ranks x 16 (batch_size is per rank).
    train = TrainConfig(epochs=epochs, batch_size=16, device="cpu", precision="fp32", seed=7)
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out, tracking_uri=None, run_id=None)


def _executor(folder: Path, nodes: int, ranks_per_node: int) -> submitit.Executor:
    cfg = ClusterConfig(
        executor="slurm", nodes=nodes, ranks_per_node=ranks_per_node, timeout_min=10
    )
    return make_executor(cfg, folder)


def _sacct(job_id: str, fields: str) -> str:
    cmd = ["sacct", "-n", "-X", "-P", "-o", fields, "-j", job_id]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout


def test_two_nodes_by_one_rank_end_with_the_weights_of_one_node_by_two_ranks(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    across = _executor(tmp_path / "a", nodes=2, ranks_per_node=1).submit(
        TrainingJob(_spec(dataset, tmp_path / "across", epochs=2))
    )
    within = _executor(tmp_path / "w", nodes=1, ranks_per_node=2).submit(
        TrainingJob(_spec(dataset, tmp_path / "within", epochs=2))
    )
    lines: list[str] = []
    ref_across = wait_for_job(across, lines.append)
    ref_within = wait_for_job(within, lambda line: None)

    assert isinstance(ref_across, CheckpointRef) and isinstance(ref_within, CheckpointRef)
    assert any(line.startswith("[rank0@tfnode1] ") for line in lines), lines[:5]
    assert any("on 2 rank(s): device cpu, backend gloo" in line for line in lines)
    a = torch.load(ref_across.path, weights_only=True)["model"]
    w = torch.load(ref_within.path, weights_only=True)["model"]
    # Bitwise: the same world of 2 ranks gets the same seed, shards and initial weights, and
    # gloo sums the same two float32 gradients whether the peer is on this node or another;
    # each rank computes with one thread (cpus_per_task=1) on the same CPU kernels.
    assert a.keys() == w.keys()
    assert all(torch.equal(a[k], w[k]) for k in a), "weights differ across layouts"
    assert _sacct(across.job_id, "State,NNodes,NodeList").strip() == "COMPLETED|2|tfnode[1-2]"


def _rank_record(job: submitit.Job[object], task: int) -> dict[str, object]:
    path = job.paths.folder / f"{job.job_id}_{task}_rank.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    assert isinstance(data, dict)
    return data


def test_a_rank_killed_on_the_second_node_is_named_and_ends_the_job(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    job = _executor(tmp_path / "k", nodes=2, ranks_per_node=1).submit(
        TrainingJob(_spec(dataset, tmp_path / "run", epochs=500))
    )
    killed: list[float] = []
    pids: list[int] = []

    def kill_rank1_after_epoch_2(line: str) -> None:
        if not killed and "epoch 2/500" in line:
            record = _rank_record(job, 1)
            assert record["slurm_node"] == "tfnode2"
            pids.extend([int(str(record["pid"])), int(str(_rank_record(job, 0)["pid"]))])
            os.kill(pids[0], signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(JobError) as failure:
        wait_for_job(job, kill_rank1_after_epoch_2)
    assert killed, "training never reached epoch 2"
    assert time.monotonic() - killed[0] < 60  # the job ends, not torch's collective timeout
    head = str(failure.value).splitlines()[0]
    assert "lost rank 1 (node tfnode2): rank 1 on node tfnode2 was killed by signal 9" in head
    assert f"log: {job.paths.folder}/{job.job_id}_1_log.err" in head
    assert "----- rank 0 (node tfnode1) traceback -----" in str(failure.value)
    assert not [pid for pid in pids if _alive(pid)], "a rank process outlived the job"
    squeue = subprocess.run(["squeue", "-h", "-j", job.job_id], capture_output=True, text=True)
    assert not squeue.stdout.strip()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_job_that_lost_a_node_restarts_on_the_other_node_to_the_same_weights(
    dataset: DatasetRef, tmp_path: Path
) -> None:
    cfg = ClusterConfig(executor="slurm", nodes=1, ranks_per_node=2, timeout_min=10)
    assert cfg.max_restarts == 1  # the default
    plain = make_executor(cfg, tmp_path / "p").submit(
        TrainingJob(_spec(dataset, tmp_path / "plain", epochs=60))
    )
    killed: list[str] = []
    lines: list[str] = []
    job_dir = tmp_path / "k"

    def kill_after_epoch_2(line: str) -> None:
        lines.append(line)
        if not killed and "epoch 2/60" in line:
            record = json.loads(next(job_dir.glob("*_1_rank.json")).read_text())
            os.kill(int(record["pid"]), signal.SIGKILL)
            killed.append(str(record["slurm_node"]))

    warnings: list[str] = []
    spec = _spec(dataset, tmp_path / "lost", epochs=60)
    ref = train_with_restarts(spec, cfg, job_dir, tmp_path, kill_after_epoch_2, warnings.append)
    ref_plain = wait_for_job(plain, lambda line: None)

    assert killed and isinstance(ref, CheckpointRef) and isinstance(ref_plain, CheckpointRef)
    assert f"lost rank 1 (node {killed[0]})" in warnings[0]
    restarted = [ln for ln in lines if f"excluding node(s) {killed[0]}" in ln]
    assert restarted, lines
    second = re.findall(r"submitted training job (\d+)", "\n".join(lines))[-1]
    node = _sacct(second, "NodeList").strip()
    assert node in {"tfnode1", "tfnode2"} and node != killed[0]
    a = torch.load(ref.path, weights_only=True)["model"]
    b = torch.load(ref_plain.path, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted job's weights differ"
