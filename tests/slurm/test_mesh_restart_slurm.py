"""A mesh job that lost a node, on the dev cluster's two nodes: tp=2 x dp_shard=2 on 2 nodes x
2 ranks loses a rank of its second node, and continues on the node left as tp=2 alone (the
mesh's dp_shard is the rest of the world), from its checkpoint resharded onto the new mesh,
with the global batch kept by accumulation; the run's history has every epoch.

tests/slurm/conftest.py starts the 2-node cluster when it is not up.
"""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.slurm.test_fsdp_multinode import _final_state
from tests.unit.datasets import write_token_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.task import train_with_restarts

pytestmark = pytest.mark.timeout(300)
EPOCHS = 24


def test_a_mesh_job_that_lost_a_node_continues_on_a_smaller_mesh(tmp_path: Path) -> None:
    train = TrainConfig(
        model="transformer",
        model_args={"dim": 32, "layers": 2, "heads": 2},
        objective="sequence",
        strategy="fsdp",
        parallel={"tp": 2},
        epochs=EPOCHS,
        batch_size=16,
        device="cpu",
        precision="fp32",
        test_after_training=False,
    )
    tokens = write_token_dataset(tmp_path / "ds", context=16, vocab=16, n_train=256, n_val=32)
    spec = TrainJobSpec(train=train, dataset=tokens, out_dir=tmp_path / "run")
    cluster = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=2, timeout_min=10)
    job_dir = tmp_path / "jobs"
    killed: list[str] = []
    lines: list[str] = []

    def kill_a_rank_on_the_second_node_after_epoch_2(line: str) -> None:
        lines.append(line)
        if not killed and f"epoch 2/{EPOCHS}" in line:
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
    meshes = [ln.rsplit("mesh ", 1)[-1] for ln in lines if "training transformer on" in ln]
    assert meshes == ["dp_shard=2 x tp=2", "tp=2"], meshes
    assert any("2 micro-batches of 16 per step" in ln for ln in lines), lines[-30:]
    assert any("resuming from" in ln for ln in lines)
    history = json.loads(ref.history_path.read_text())
    assert [h["epoch"] for h in history] == list(range(1, EPOCHS + 1))
    per_epoch = history[0]["step"]  # the global batch kept: as many steps an epoch throughout
    assert [h["step"] for h in history] == [per_epoch * e for e in range(1, EPOCHS + 1)]
    second = re.findall(r"submitted training job (\d+)", "\n".join(lines))[-1]
    assert _final_state(second).startswith("COMPLETED|1|")
