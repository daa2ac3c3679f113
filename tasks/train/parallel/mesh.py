"""The device mesh of a train.strategy=fsdp job, and each rank's place in its data-parallel
dimension.

One mesh for the whole job, built once after the process group (tasks.train.distributed):
FSDP2 shards over its data-parallel dimensions (a 2-D replicate x shard submesh is HSDP), the
tensor-parallel plan splits layers over its `tp` dimension (tasks.train.parallel.
tensor_parallel). The data side (batches, metric sums, the global batch) then counts
data-parallel ranks, not ranks: a tensor-parallel group takes one batch together, and its
ranks' metric sums are of the same samples, so the sums are all-reduced over one group of
ranks per tp coordinate (`dp_group`). The stages of a pipeline (`pp`) take one batch together
too; only the last stage has the outputs, so the others add zeros to those sums.
"""

from dataclasses import replace
from typing import TYPE_CHECKING

import torch.distributed as dist

from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.parallel.layout import DIMENSIONS, MeshShape, job_shape

if TYPE_CHECKING:  # imports DTensor (~0.7 s): a ddp run never needs it
    from torch.distributed.device_mesh import DeviceMesh


def build_mesh(shape: MeshShape, ctx: DistContext) -> "DeviceMesh":
    """The mesh of `shape` over the job's ranks, on this rank's device type (gloo on CPU,
    NCCL on GPU: the process group's backends), with the dimensions of size above 1 (one
    dimension of size 1 on a world of one)."""
    from torch.distributed.device_mesh import init_device_mesh

    named = [(d, getattr(shape, d)) for d in DIMENSIONS if getattr(shape, d) > 1]
    named = named or [("dp_shard", 1)]
    names, sizes = zip(*named, strict=True)
    return init_device_mesh(ctx.device.type, sizes, mesh_dim_names=names)


def data_mesh(mesh: "DeviceMesh") -> "DeviceMesh | None":
    """The submesh FSDP2 shards over: (dp_replicate, dp_shard) for HSDP, either one alone, or
    None when the mesh has no data-parallel dimension (tensor parallelism over every rank)."""
    names = [d for d in ("dp_replicate", "dp_shard") if d in (mesh.mesh_dim_names or ())]
    if not names:
        return None
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def tensor_mesh(mesh: "DeviceMesh") -> "DeviceMesh | None":
    """The `tp` submesh, None when layers are not split."""
    return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None


def pipeline_mesh(mesh: "DeviceMesh | None") -> "DeviceMesh | None":
    """The `pp` submesh (this rank's pipeline: one rank per stage), None without stages."""
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["pp"]


def on_mesh(ctx: DistContext, shape: MeshShape) -> DistContext:
    """`ctx` on the mesh of `shape` (collective, on several ranks): the mesh, and its
    data-parallel place: `tp` ranks per group, `pp` stages per pipeline, and when tp > 1 the
    group of ranks with this rank's tp coordinate (every stage's), over which metric sums are
    all-reduced (every rank creates every group, as torch.distributed requires)."""
    if ctx.world_size == 1:
        return ctx
    mesh = build_mesh(shape, ctx)
    if shape.tp == 1:
        return replace(ctx, pp=shape.pp, mesh=mesh)
    others = shape.world // shape.tp
    groups = [[t + k * shape.tp for k in range(others)] for t in range(shape.tp)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return replace(ctx, tp=shape.tp, pp=shape.pp, dp_group=mine, mesh=mesh)


def on_job_mesh(ctx: DistContext, cfg: TrainConfig) -> DistContext:
    """`ctx` on the mesh train.parallel lays out (train.strategy=fsdp; collective), as it is
    under ddp. ConfigError when the sizes do not make up the job's ranks (a restart on fewer
    ranks included)."""
    if cfg.strategy != "fsdp":
        return ctx
    return on_mesh(ctx, job_shape(cfg.strategy, cfg.parallel, ctx.world_size))
