"""Gradient clipping by the global norm: all of the model's gradients, on every rank and shard.

Under DDP each rank holds the whole gradient, all-reduced, so its own norm is the global one.
Under FSDP2 each rank holds shards (DTensors): torch's norm of them is a DTensor, reduced over
the ranks (torch 2.13 returns it replicated; `full_tensor()` makes it a plain tensor, and
completes the sum where a version leaves it partial), the torchtitan way. A model whose
parameters live on different meshes, or partly on none, is normed per mesh and the norms
combined: torch's norm takes one kind at a time ("got mixed torch.Tensor and DTensor"). That is
a model split by a plan that leaves some layers whole (transformers' Llama plan splits the
projections but not the norms: plain tensors under tensor parallelism alone, on the
data-parallel mesh only under FSDP2 beside the split ones on the 2-D mesh). Under fp16 the
caller unscales the gradients first (`GradScaler.unscale_`), so the norm and the clip are in
the gradients' own units.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def clip_gradients(
    model: nn.Module, max_norm: float, stages: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale the gradients of `model` so that their global L2 norm is at most `max_norm`;
    returns the norm before clipping, a plain scalar tensor equal on every rank. It is inf or
    nan when a gradient is (under fp16 the GradScaler then skips the step). `stages`: `model`
    is one pipeline stage and this group the ranks holding the others: the squares of their
    norms are summed (torchtitan's way), so every stage clips by the whole model's norm."""
    groups: dict[object, list[torch.Tensor]] = {}  # by mesh (None: plain tensors)
    for p in model.parameters():
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    norms = [_norm(params) for params in groups.values()] or [torch.zeros(())]
    norm = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms)
    if stages is not None:
        squared = norm**2
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=stages)
        norm = squared.sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the gradients of `params` (all on one mesh, or none), a plain tensor."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
