"""Tensor parallelism across two nodes of the dev Slurm: tp=2 x dp_shard=2 on 2 nodes x 2
ranks (each tp group within a node, as the layout puts it) trains as DDP on 2 local ranks on
the same global batch, within tests/unit/test_tensor_parallel.py's bound (why there)."""

from pathlib import Path

import pytest

from tests.unit.datasets import write_token_dataset
from tests.unit.test_tensor_parallel import assert_same_training, train
from trainflow.cluster.config import ClusterConfig


@pytest.mark.timeout(600)
def test_tp2_by_dp_shard2_on_two_slurm_nodes_trains_as_ddp(tmp_path: Path) -> None:
    tokens = write_token_dataset(tmp_path / "ds", context=32, vocab=40, n_train=768, n_val=128)
    ddp = train(tokens, tmp_path / "ddp", 2, strategy="ddp")
    slurm = ClusterConfig(executor="slurm", nodes=2, ranks_per_node=2, timeout_min=10)
    mesh = train(tokens, tmp_path / "mesh", 4, slurm, strategy="fsdp", parallel={"tp": 2})
    assert_same_training(mesh, ddp)
