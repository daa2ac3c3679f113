"""Real gloo rank processes for the resharding tests: ranks that train the charlm transformer
under FSDP with AdamW and write a sharded checkpoint
(tasks.train.checkpointing.sharded_checkpoint), and
ranks, as many or fewer, that load it; each side's whole model and optimizer state, gathered,
goes to a file the test compares value by value. A world of one runs as the training job runs
it: no process group, the model not sharded, DCP without collectives."""

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from tests.unit import fsdp_ranks
from trainflow.tasks.train.checkpointing.checkpoint import host_copy
from trainflow.tasks.train.checkpointing.sharded_checkpoint import ShardedSaver, load_sharded
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.sharded_init import build_on_rank, shard_from_rank0
from trainflow.tasks.train.sharding import local_numel


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state gathered whole onto rank 0's host (collective), copied: a
    tensor not sharded (AdamW's step count, a world of one's everything) is the live one."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return host_copy({"model": model_state, "optimizer": optim_state})


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> None:
    """Optimizer steps on this rank's share of fsdp_ranks' global batches."""
    share = fsdp_ranks.GLOBAL_BATCH // world
    for x, y in fsdp_ranks.global_batches()[:2]:
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _rank(
    rank: int, world: int, port: int, load: str, save: str, out: str, optimizer_ref: str
) -> None:
    torch.set_num_threads(1)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), "gloo")
    model = build_on_rank(fsdp_ranks.tiny_model, "fsdp", ctx)
    model = shard_from_rank0(model, ctx, fsdp_ranks.policy_for("fp32"))
    optimizer = make_optimizer(TrainConfig(lr=1e-2, optimizer=optimizer_ref), model)
    results: dict[str, Any] = {}
    if load:
        load_sharded(model, optimizer, Path(load))
        results["loaded"] = whole_state(model, optimizer)
        states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        results["local"] = [local_numel(model.parameters()), local_numel(states)]
    if save:
        _steps(model, optimizer, rank, world)
        saver = ShardedSaver(ctx)
        saver.save(model, optimizer, {"epoch": 1}, Path(save), 1)
        saver.wait()
        results["saved"] = whole_state(model, optimizer)
    local: list[Any] = [results.get("local")]
    if world > 1:
        local = [None] * world
        dist.all_gather_object(local, results.get("local"))
        dist.destroy_process_group()
    if rank == 0:
        torch.save({**results, "local": local}, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests.unit.fsdp_ranks' ranks leave (no interpreter teardown)


def run_ranks(
    world: int, load: Path | None, save: Path | None, out: Path, optimizer: str = "adamw"
) -> dict[str, Any]:
    """`world` rank processes that load the checkpoint folder `load` (if any), then train
    and write theirs under `save` (if any), with train.optimizer=`optimizer`; rank 0's
    results: the whole state `loaded` and `saved`, and each rank's `local` [parameter,
    optimizer state] element counts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (world, port, str(load or ""), str(save or ""), str(out), optimizer)
    mp.start_processes(_rank, args, nprocs=world, start_method="spawn")
    results: dict[str, Any] = torch.load(out, weights_only=False)
    return results
