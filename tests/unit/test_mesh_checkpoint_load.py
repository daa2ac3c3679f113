"""A checkpoint written on one mesh loads on another, values equal: a tp=2 x dp_shard=2 job's
sharded checkpoint (torch.distributed.checkpoint) loaded by 4 gloo ranks sharding the model
and its AdamW state 4 ways (dp_shard=4), and by one process, against the checkpoint read
whole by DCP's own converter (dcp_to_torch_save: no mesh at all)."""

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.unit.datasets import write_token_dataset
from tests.unit.test_tensor_parallel import train
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.checkpointing.sharded_checkpoint import (
    full_weights,
    load_sharded,
    sharded_checkpoints,
)
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.parallel.layout import MeshShape
from trainflow.tasks.train.parallel.mesh import on_mesh
from trainflow.tasks.train.precision import resolve_precision
from trainflow.tasks.train.sharding import wrap_fsdp
from trainflow.tasks.train.transformer import transformer

SPEC = DataSpec((32,), "int64", "sequence", 40, (32,))
ARGS: dict[str, Any] = {"dim": 64, "layers": 2, "heads": 4}


def _load(rank: int, world: int, folder: str, store: str, out: str) -> None:
    """Rank `rank` of `world`: the model sharded dp_shard=world, filled from `folder`; rank 0
    saves the whole weights it gathers."""
    if world > 1:
        url = f"file://{store}"
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    try:
        ctx = DistContext(rank, world, 0, torch.device("cpu"), "gloo" if world > 1 else None)
        ctx = on_mesh(ctx, MeshShape(dp_shard=world))
        model = transformer(SPEC, **ARGS)
        model = wrap_fsdp(model, ctx, resolve_precision("fp32", ctx.device))
        cfg = TrainConfig(model="transformer", model_args=ARGS, objective="sequence")
        optimizer = make_optimizer(cfg, model)
        load_sharded(model, optimizer, Path(folder))
        whole = full_weights(model)
        if rank == 0:
            torch.save(whole, out)
    finally:
        if world > 1:
            dist.destroy_process_group()


def test_a_tp_by_dp_checkpoint_loads_on_four_shards_and_on_one_process(tmp_path: Path) -> None:
    tokens = write_token_dataset(tmp_path / "ds", context=32, vocab=40, n_train=768, n_val=128)
    keys: dict[str, Any] = {"strategy": "fsdp", "parallel": {"tp": 2}, "optimizer": "adamw"}
    train(tokens, tmp_path / "mesh", 4, **keys, max_steps=4, checkpoint_every_steps=4)
    folder = sharded_checkpoints(tmp_path / "mesh" / "run" / "checkpoints")[0]
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    want = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    four, one = tmp_path / "four.pt", tmp_path / "one.pt"
    mp.spawn(_load, args=(4, str(folder), str(tmp_path / "store"), str(four)), nprocs=4)
    _load(0, 1, str(folder), "", str(one))
    for got in (torch.load(four, weights_only=True), torch.load(one, weights_only=True)):
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
