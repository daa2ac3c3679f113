"""Real gloo rank processes for the sharding tests: each trains a tiny transformer (the charlm
example's) on its share of a fixed global batch under DDP or FSDP, with trainflow's own
wrappers, and rank 0 saves what the tests compare (final full weights, losses, the first
step's full gradient norm, each rank's local shard sizes). Under FSDP the ranks build the
model as the training job's do (tasks.train.sharded_init): rank 0 whole, the others on the
meta device, rank 0's weights and buffers broadcast into the shards."""

import math
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

from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.checkpointing.checkpoint import save_best_weights, unwrap
from trainflow.tasks.train.checkpointing.sharded_checkpoint import full_weights
from trainflow.tasks.train.clipping import clip_gradients
from trainflow.tasks.train.distributed import DistContext, wrap_ddp
from trainflow.tasks.train.first_result import load_best
from trainflow.tasks.train.precision import PrecisionPolicy
from trainflow.tasks.train.sharded_init import build_on_rank, shard_from_rank0
from trainflow.tasks.train.sharding import local_numel

# The charlm example is a user's project, not a package: imported as its runs import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "charlm"))
from char_transformer import build

VOCAB, CONTEXT, GLOBAL_BATCH, STEPS = 24, 16, 8, 4
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def policy_for(precision: str, device_type: str = "cpu") -> PrecisionPolicy:
    """The fp32 or bf16 policy on `device_type`."""
    return PrecisionPolicy(device_type, DTYPES[precision], False, precision)


def tiny_model() -> nn.Module:
    """The charlm transformer, 2 blocks of width 32, no dropout (ranks draw no randomness)."""
    torch.manual_seed(0)
    spec = DataSpec((CONTEXT,), "int64", "sequence", VOCAB, (CONTEXT,))
    return build(spec, dim=32, layers=2, heads=2, dropout=0.0)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of next-token data (ids, targets), the same in every process."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, CONTEXT + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def train(
    model: nn.Module,
    policy: PrecisionPolicy,
    rank: int,
    world: int,
    device: str = "cpu",
    max_norm: float = 0.0,
) -> tuple[list[float], float, torch.optim.Optimizer, list[float]]:
    """STEPS SGD steps on this rank's contiguous share of each global batch; returns the
    global losses (averaged over ranks), the first step's full gradient norm, the optimizer
    and, when `max_norm` clips the gradients (trainflow's clip_gradients), the norm it
    returned each step and the first step's full norm after clipping. SGD with momentum
    (state to shard), not Adam: Adam's normalisation turns rounding-level gradient
    differences into lr-sized weight differences."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    share = GLOBAL_BATCH // world
    losses, first_norm, clipped = [], math.nan, []
    for step, (x, y) in enumerate(global_batches()):
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        x, y = x.to(device), y.to(device)
        with policy.autocast():
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            first_norm = grad_norm(model)
        if max_norm:
            clipped.append(float(clip_gradients(model, max_norm)))
            if step == 0:
                clipped.append(grad_norm(model))
        optimizer.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses, first_norm, optimizer, clipped


def grad_norm(model: nn.Module) -> float:
    """The L2 norm of the whole gradient (a sharded one gathered: collective under FSDP)."""
    squares = 0.0
    for p in model.parameters():
        assert p.grad is not None
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        squares += float(g.float().pow(2).sum())
    return math.sqrt(squares)


def single_process(precision: str, max_norm: float = 0.0) -> dict[str, Any]:
    """The reference: the whole global batch in this process."""
    model = tiny_model()
    losses, norm, _, clipped = train(model, policy_for(precision), 0, 1, max_norm=max_norm)
    return {"losses": losses, "grad_norm": norm, "weights": model.state_dict(), "clip": clipped}


def _rank(
    rank: int,
    world: int,
    port: int,
    runs: list[tuple[str, str]],
    out: str,
    device_type: str,
    max_norm: float,
) -> None:
    torch.set_num_threads(1)
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, device_id=device if cuda else None
    )
    ctx = DistContext(rank, world, rank, device, backend)
    results: dict[str, Any] = {}
    for strategy, precision in runs:
        policy = policy_for(precision, device_type)
        # as the training job builds it: under fsdp rank 0 builds, the others on meta
        model = build_on_rank(tiny_model, strategy, ctx)
        full = sum(p.numel() for p in model.parameters())
        on_meta = all(p.is_meta for p in model.parameters())
        draw = float(torch.rand(()))  # the RNG as the build left it (training draws none)
        if strategy == "fsdp":
            model = shard_from_rank0(model, ctx, policy)
        else:
            model = wrap_ddp(model.to(device), ctx)
        losses, norm, optimizer, clipped = train(model, policy, rank, world, str(device), max_norm)
        states = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        local = {
            "params": local_numel(model.parameters()),
            "grads": local_numel(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": local_numel(states),
            "full_params": full,
            "built_on_meta": on_meta,
            "draw_after_build": draw,
        }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local)
        if strategy == "fsdp":
            weights = full_weights(model)
        else:
            weights = {k: v.cpu().clone() for k, v in unwrap(model).state_dict().items()}
        # The first result's load of best.pt (tasks.train.first_result): the built weights
        # back into the trained model, DDP-wrapped or sharded.
        best = Path(f"{out}.best.pt")
        if rank == 0:
            save_best_weights(tiny_model().state_dict(), best, {})
        load_best(model, best, ctx)
        reloaded = full_weights(model) if strategy == "fsdp" else unwrap(model).state_dict()
        if rank == 0:
            results[f"{strategy}-{precision}"] = {
                "losses": losses,
                "grad_norm": norm,
                "clip": clipped,
                "weights": weights,
                "local": gathered,
                "reloaded": {k: v.cpu() for k, v in reloaded.items()},
            }
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    # Leave as a training job's rank does (tasks/train/distributed.py exit_fast_at_shutdown):
    # no interpreter teardown. With it, a spawned rank died at exit now and then with
    # "terminate called without an active exception" (SIGABRT, 3 of ~8 runs under load 5+),
    # after its results were written: a C++ thread still joinable when static destructors run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    world: int,
    runs: list[tuple[str, str]],
    out: Path,
    device_type: str = "cpu",
    max_norm: float = 0.0,
) -> dict[str, Any]:
    """Start `world` rank processes (gloo on CPU; NCCL, a GPU each, on cuda) that train each
    (strategy, precision) of `runs` in turn, clipping at `max_norm` when set; rank 0's
    results, by "strategy-precision"."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (world, port, runs, str(out), device_type, max_norm)
    mp.start_processes(_rank, args, nprocs=world, start_method="spawn")
    results: dict[str, Any] = torch.load(out, weights_only=False)
    return results
