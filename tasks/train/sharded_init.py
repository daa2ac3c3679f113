"""How the ranks of a train.strategy=fsdp job come to hold their shards without each building
the whole model: rank 0 builds it (seeded: the weights a DDP or one-process run starts from),
every other rank builds it on the meta device (no memory), all shard it, and rank 0's weights
are broadcast tensor by tensor into everyone's shards.

Peak host memory while starting: rank 0 the whole model once (its host copy, dropped once
distributed) plus its shards; every other rank its shards plus one whole tensor at a time
(the one being broadcast). Afterwards every rank holds 1/N of the parameters.

Under DDP, or on one rank, every rank builds the whole model as before: one code path, the
meta build is the only difference.

Freed memory goes back to the system under fsdp (fixed_mmap_threshold): FSDP allocates and
frees each unit's gathered parameters and gradients every step, and glibc's malloc, whose
mmap threshold grows to the largest block freed so far, then serves those blocks from its
heap and keeps them: measured here (charlm 512x8, 25M parameters, 4 gloo ranks, 3 AdamW
steps) each rank's RSS grew 270 -> 890-1010 MiB, step after step, against 270 -> 422 MiB
(peak 515) with the threshold fixed at 128 KiB: FSDP's saving gone, and more. The price on
CPU: a page fault per page of every gathered block, every step (bench P9: 1.7x the step time
at 4 ranks). On a GPU the gathered blocks are CUDA memory, which malloc does not serve.
"""

import ctypes
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.precision import PrecisionPolicy
from trainflow.tasks.train.sharding import wrap_fsdp


def builds_on_meta(strategy: str, ctx: DistContext) -> bool:
    """True on the ranks that build the model on the meta device: all but rank 0 of an fsdp
    job of several ranks."""
    return strategy == "fsdp" and ctx.world_size > 1 and not ctx.is_main


def build_on_rank(build: Callable[[], nn.Module], strategy: str, ctx: DistContext) -> nn.Module:
    """`build()` on this rank (call it after seeding: every rank that builds gets the same
    weights): on the meta device where builds_on_meta, else as it is; under fsdp with
    malloc's mmap threshold fixed first (fixed_mmap_threshold).

    Under fsdp on several ranks rank 0's torch (CPU) and python RNG states are then broadcast
    (a meta build draws no random numbers): every rank continues from the state a DDP rank has
    after building, so dropout and data order match a DDP run's (collective)."""
    if not builds_on_meta(strategy, ctx):
        model = build()
    else:
        with torch.device("meta"):
            model = build()
    if strategy == "fsdp":
        fixed_mmap_threshold()
    if strategy == "fsdp" and ctx.world_size > 1:
        # torch's CPU generator and python's: the build draws from those (on the host); CUDA
        # generators are seeded alike on every rank and untouched by it (and the number of
        # devices a rank sees may differ)
        state: list[Any] = [(torch.get_rng_state(), random.getstate()) if ctx.is_main else None]
        dist.broadcast_object_list(state, src=0)
        torch.set_rng_state(state[0][0])
        random.setstate(state[0][1])
    return model


def shard_from_rank0(
    model: nn.Module,
    ctx: DistContext,
    policy: PrecisionPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """`model` sharded with wrap_fsdp and filled with rank 0's weights and buffers (collective).

    Rank 0 passes the model it built, the others their meta build (build_on_rank). Rank 0's
    state dict is taken before sharding (it references the whole tensors fully_shard replaces
    by shards), the others allocate their shards (`to_empty`), and DCP's set_model_state_dict
    broadcasts each tensor from rank 0, every rank keeping its shard. Buffers (not sharded)
    are then broadcast whole: non-persistent ones are not in the state dict. Under pipeline
    stages (train.parallel.pp) each rank keeps its stage of the model (cut before sharding)
    and takes its stage's tensors. On one rank this is wrap_fsdp."""
    if ctx.world_size == 1:
        return wrap_fsdp(model, ctx, policy, reshard_after_forward)
    from trainflow.tasks.train.parallel.pipeline import this_stage

    full = model.state_dict() if ctx.is_main else {}
    buffers = dict(model.named_buffers()) if ctx.is_main else {}  # the other stages' too
    model = wrap_fsdp(this_stage(model, ctx), ctx, policy, reshard_after_forward)
    if not ctx.is_main:
        model.to_empty(device=ctx.device)
    fill_from_rank0(model, full, ctx, buffers)
    del full, buffers  # rank 0's host copy of the whole model
    return model


def fill_from_rank0(
    model: nn.Module,
    full: dict[str, Any],
    ctx: DistContext,
    buffers: dict[str, torch.Tensor] | None = None,
) -> None:
    """Rank 0's whole state dict `full` ({} on the other ranks) into the sharded `model`
    (collective): DCP's set_model_state_dict broadcasts each tensor from rank 0, every rank
    keeping its shard; buffers are then broadcast whole (non-persistent ones are not in a
    state dict). Also the fsdp model's load of best.pt (tasks.train.first_result). A pipeline
    stage takes the tensors it holds, and rank 0's stage leaves the other stages' (not
    strict: the names are checked by tasks.train.parallel.pipeline.stage_module); its buffers
    come from rank 0's whole model's, `buffers` (given when it starts; a load of best.pt keeps
    the non-persistent ones it has)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    many = ctx.world_size > 1
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=many, strict=ctx.pp == 1)
    set_model_state_dict(model, full, options=options)
    if many and ctx.pp == 1:
        with torch.no_grad():
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
    elif many and buffers is not None:
        stage_buffers(model, buffers, ctx)


def stage_buffers(model: nn.Module, whole: dict[str, torch.Tensor], ctx: DistContext) -> None:
    """Rank 0's buffers of the whole model, `whole` ({} on the other ranks), into each
    pipeline stage's buffers of the same names (collective): one broadcast of them all, on the
    host (buffers are small: norms' running statistics, position tables)."""
    sent: list[Any] = [{k: v.cpu() for k, v in whole.items()} if ctx.is_main else None]
    dist.broadcast_object_list(sent, src=0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(sent[0][name])


M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
MMAP_THRESHOLD = 128 << 10
"""glibc's default initial threshold: blocks this large or larger are mmapped, and unmapped
(returned to the system) when freed."""


def fixed_mmap_threshold() -> bool:
    """Fix glibc malloc's mmap threshold at MMAP_THRESHOLD, which also stops it growing
    (mallopt: the dynamic threshold is off once set): large blocks freed by FSDP every step
    return to the system instead of staying in the heap. False where the C library has no
    mallopt (not glibc): nothing changed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
