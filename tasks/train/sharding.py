"""Sharded data parallelism (train.strategy=fsdp): FSDP2 `fully_shard` over the job's ranks.

Every sharding unit (a model's repeated block) becomes its own FSDP group: its parameters are
split over the ranks (dim 0, 1/N each), gathered just before the unit runs and freed after it
(`reshard_after_forward`); its gradients are reduce-scattered (averaged) so each rank keeps the
1/N it owns, and the optimizer, built after sharding, holds state for that 1/N only. The root
module is one more group: whatever no unit holds (embeddings, heads, norms).

Which modules are units:
- a model names them with a method ``shard_units(self) -> Iterable[nn.Module]`` (the built-ins
  and examples/charlm do: their residual/transformer blocks);
- a Hugging Face `transformers` model by its own list of blocks that must not be split
  (``_no_split_modules``, the class names Accelerate wraps as FSDP units: GPT2Block,
  LlamaDecoderLayer...): every submodule of those classes (`no_split_units`);
- otherwise (`default_units`): every direct child holding parameters, the items of a
  ``nn.ModuleList`` / ``nn.Sequential`` child counting as children; a child sharing a parameter
  with another (tied weights) stays with the root, since a shared parameter must live in one
  group.

The device mesh is explicit, one dimension over all ranks, on the rank's device type
(``init_device_mesh("cpu", ...)`` gives a gloo mesh; torch's default follows the accelerator).
"""

import functools
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainflow.errors import ConfigError
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.precision import PrecisionPolicy

if TYPE_CHECKING:  # imported where used: FSDP imports DTensor and sympy (~0.7 s), which a DDP
    # run, and the flow process that imports this module with the training job, never need
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

UNITS_METHOD = "shard_units"
"""The method by which a model names its sharding units (its repeated blocks)."""
NO_SPLIT_ATTRIBUTE = "_no_split_modules"
"""The attribute in which a transformers model names its block classes (a set or list)."""


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP groups of their own: `model.shard_units()` when the model
    defines it, else default_units(model). ConfigError when what the model names is not a list
    of its own submodules."""
    named = getattr(model, UNITS_METHOD, None)
    if named is None:
        return no_split_units(model) or default_units(model)
    units = list(named())
    own = {id(m) for m in model.modules() if m is not model}
    strays = [type(u).__name__ for u in units if not isinstance(u, nn.Module) or id(u) not in own]
    if strays:
        raise ConfigError(
            f"{type(model).__name__}.{UNITS_METHOD}() returned {strays}, which are not "
            "submodules of the model: return the model's own blocks (nn.Module instances)"
        )
    return units


def no_split_units(model: nn.Module) -> list[nn.Module]:
    """The submodules whose class a transformers model names in its `_no_split_modules` (its
    blocks), outermost first; [] for a model that names none."""
    names = set(getattr(model, NO_SPLIT_ATTRIBUTE, None) or ())
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside or type(module).__name__ not in names:
            continue
        units.append(module)
        inside |= {id(m) for m in module.modules()}
    return units


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every direct child holding parameters (the items of ModuleList/Sequential children
    counted as children), less any that shares a parameter with another (tied weights)."""
    candidates: list[nn.Module] = []
    for child in model.children():
        items = child if isinstance(child, nn.ModuleList | nn.Sequential) else [child]
        candidates += [m for m in items if any(True for _ in m.parameters())]
    owners: dict[int, int] = {}
    for index, unit in enumerate(candidates):
        for p in unit.parameters():
            owners.setdefault(id(p), index)
    shared = {
        index
        for index, unit in enumerate(candidates)
        for p in unit.parameters()
        if owners[id(p)] != index
    }
    shared |= {owners[id(p)] for i in shared for p in candidates[i].parameters()}
    return [unit for index, unit in enumerate(candidates) if index not in shared]


def checkpoint_activations(units: Iterable[nn.Module]) -> None:
    """Make each unit recompute its activations in the backward pass (non-reentrant
    torch.utils.checkpoint around its forward) instead of keeping them. State-dict keys and
    hooks (FSDP's gather before the unit runs) are unchanged: only `forward` is replaced."""
    for unit in units:
        forward: Callable[..., Any] = unit.forward
        unit.forward = functools.partial(_checkpointed, forward)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def mixed_precision(policy: PrecisionPolicy) -> "MixedPrecisionPolicy":
    """bf16 parameters for compute and fp32 gradient reduction under the bf16 policy (the
    sharded fp32 master weights and optimizer stay fp32); plain fp32 otherwise.

    Not fp32 parameters inside the loop's autocast, which would compute exactly as DDP does:
    autocast's bf16 copy of every weight would then be kept from the forward pass to the
    backward pass, the whole model's on every rank (bench P10). The price is a forward pass in
    bf16 throughout, against autocast's fp32 residual stream and norms: a slow drift from the
    DDP run, bounded in docs/training.md and tests/unit/test_fsdp_vs_ddp.py."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy.dtype == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if policy.dtype is not None:
        raise ConfigError(
            f"train.strategy=fsdp does not support precision {policy.name} ({policy.reason}): "
            "set train.precision=bf16 or fp32"
        )
    return MixedPrecisionPolicy()


def device_mesh(ctx: DistContext) -> "DeviceMesh":
    """The job's mesh (ctx.mesh, train.parallel: tasks.train.parallel.mesh), or else a
    one-dimensional mesh of all ranks on this rank's device type (gloo on CPU, NCCL on GPU:
    the backends the process group was started with)."""
    if ctx.mesh is not None:
        return ctx.mesh
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp_shard",))


def wrap_fsdp(
    model: nn.Module,
    ctx: DistContext,
    policy: PrecisionPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """`model` split and sharded in place: its layers split over the mesh's `tp` dimension
    by its plan (tasks.train.parallel.tensor_parallel) when there is one, then FSDP2 over the
    data-parallel dimensions, each of sharding_units(model) and then the root. Build the
    optimizer afterwards: its parameters are the shards (DTensors).

    Pass the model on the host (as built): fully_shard moves each unit to the rank's device
    as it shards it, so the device holds the shards and at most one unit whole, never the
    whole model. A world of one is moved to the device and not sharded."""
    if ctx.world_size == 1:
        mixed_precision(policy)  # the same refusal as on several ranks
        return model.to(ctx.device)
    from torch.distributed.fsdp import fully_shard

    from trainflow.tasks.train.parallel.mesh import data_mesh, tensor_mesh
    from trainflow.tasks.train.parallel.tensor_parallel import split_layers

    mesh = device_mesh(ctx)
    mp = mixed_precision(policy)
    tp_mesh, dp_mesh = tensor_mesh(mesh), data_mesh(mesh)
    if tp_mesh is not None:
        model = split_layers(model, tp_mesh, ctx.tp)
    if dp_mesh is None:  # every rank in one tensor-parallel group: nothing to shard
        on_meta = any(p.is_meta for p in model.parameters())  # filled later (to_empty)
        return model if on_meta else model.to(ctx.device)
    for unit in sharding_units(model):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # The root's parameters are needed again first thing in the backward pass: keep them.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when `model` was sharded or split by wrap_fsdp (an FSDP2 module, or parameters
    that are DTensors: tensor parallelism alone): its forward passes are collectives. Without
    DTensor imported (by wrap_fsdp) no module can be one."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(model, fsdp.FSDPModule):
        return True
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters())


def local_numel(tensors: Iterable[torch.Tensor]) -> int:
    """Elements this rank holds of `tensors`: a DTensor's local shard, a tensor's whole."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel()
    return total
