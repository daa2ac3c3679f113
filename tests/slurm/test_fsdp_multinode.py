"""train.strategy=fsdp across the dev cluster's two nodes: 2 nodes x 2 ranks shard the model
four ways, write a shard each into every checkpoint, and the whole best.pt loads as usual.

tests/slurm/conftest.py starts the 2-node cluster when it is not up.
"""

import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_job
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.models import mlp
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.sharded_checkpoint import sharded_checkpoints

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
    sacct = ["sacct", "-n", "-X", "-P", "-o", "State,NNodes,NodeList", "-j", job.job_id]
    out = subprocess.run(sacct, capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip() == "COMPLETED|2|tfnode[1-2]"
