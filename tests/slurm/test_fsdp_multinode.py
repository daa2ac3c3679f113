"""train.strategy=fsdp across the dev cluster's two nodes: 2 nodes x 2 ranks shard the model
four ways, write a shard each into every checkpoint, and the whole best.pt loads as usual; a
job that lost a node continues on the ranks left, from its checkpoint resharded 4 -> 2.

tests/slurm/conftest.py starts the 2-node cluster when it is not up.
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
import pytest
import torch

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.checkpointing.sharded_checkpoint import sharded_checkpoints
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.models import mlp
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.task import train_with_restarts

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_fsdp_on_two_nodes_by_two_ranks_writes_four_shards_and_a_whole_best(
    tmp_path: Path,
) -> None:
    train = TrainConfig(
        model="mlp", strategy="fsdp", epochs=2, batch_size=16, device="cpu", precision="fp32"
    )
    spec = TrainJobSpec(
        train=train, dataset=write_dataset(tmp_path / "ds"), out_dir=tmp_path / "run"
    )
    cfg = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=2, timeout_min=10)
    job = make_executor(cfg, tmp_path / "jobs").submit(TrainingJob(spec))
    lines: list[str] = []
    ref = wait_for_job(job, lines.append)

    assert isinstance(ref, CheckpointRef)
    assert any("on 4 rank(s): device cpu, backend gloo" in line for line in lines), lines[-20:]
    newest = sharded_checkpoints(tmp_path / "run" / "checkpoints")[0]
    assert sorted(p.name for p in newest.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    spec_ = DataSpec((1, 12, 12), "float32", "classification", 4, ())
    mlp(spec_).load_state_dict(torch.load(ref.path, weights_only=True)["model"])
    assert _final_state(job.job_id) == "COMPLETED|2|tfnode[1-2]"


def _final_state(job_id: str) -> str:
    """sacct's State|NNodes|NodeList once the job has left RUNNING (the result is read as soon
    as rank 0 wrote it; Slurm records the end a moment later)."""
    sacct = ["sacct", "-n", "-X", "-P", "-o", "State,NNodes,NodeList", "-j", job_id]
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(sacct, capture_output=True, text=True, timeout=30, check=True)
        state = out.stdout.strip()
        if not state.startswith(("RUNNING", "COMPLETING")) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def test_an_fsdp_job_that_lost_a_node_continues_on_the_ranks_left_from_its_resharded_checkpoint(
    tmp_path: Path,
) -> None:
    train = TrainConfig(
        model="mlp", strategy="fsdp", epochs=40, batch_size=16, device="cpu", precision="fp32"
    )
    out = tmp_path / "run"
    spec = TrainJobSpec(train=train, dataset=write_dataset(tmp_path / "ds"), out_dir=out)
    cluster = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=2, timeout_min=10)
    job_dir = tmp_path / "jobs"
    killed: list[str] = []
    lines: list[str] = []

    def kill_a_rank_on_the_second_node_after_epoch_2(line: str) -> None:
        lines.append(line)
        if not killed and "epoch 2/40" in line:
            record = json.loads(next(job_dir.glob("*_3_rank.json")).read_text())
            os.kill(int(record["pid"]), signal.SIGKILL)
            killed.append(str(record["slurm_node"]))

    warnings: list[str] = []
    ref = train_with_restarts(
        spec,
        cluster,
        job_dir,
        tmp_path,
        kill_a_rank_on_the_second_node_after_epoch_2,
        warnings.append,
    )

    assert killed and isinstance(ref, CheckpointRef)
    assert f"lost rank 3 (node {killed[0]})" in warnings[0]
    assert any("on 1 of the 1 node(s) left (2 ranks" in ln for ln in lines), lines[-30:]
    kept = [ln for ln in lines if "global batch 64 kept: the run started on 4 ranks" in ln]
    assert kept and "on 2 ranks x 2 micro-batches of 16 per step" in kept[0], lines[-30:]
    assert any("on 2 rank(s): device cpu" in ln for ln in lines)
    resumed = [ln for ln in lines if "resuming from" in ln]
    assert resumed and "epoch-0000" in resumed[0]
    second = re.findall(r"submitted training job (\d+)", "\n".join(lines))[-1]
    state = _final_state(second)
    assert state.startswith("COMPLETED|1|") and killed[0] not in state
    history = json.loads(ref.history_path.read_text())
    assert [h["epoch"] for h in history] == list(range(1, 41))
    per_epoch = history[0]["step"]  # the global batch kept: as many steps an epoch throughout
    assert [h["step"] for h in history] == [per_epoch * e for e in range(1, 41)]
    newest = sharded_checkpoints(out / "checkpoints")[0]
    assert sorted(p.name for p in newest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
