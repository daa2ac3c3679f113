"""Pipeline parallelism: a model's layers cut into stages over the mesh's `pp` dimension, one
stage per rank, and the training step that runs them (torch.distributed.pipelining).

Where a model gets its cut: its own method ``pp_split(self, stage: int, stages: int) ->
nn.Module`` (the built-in `transformer` has one; a user's model names its cut the same way),
else, for a Hugging Face transformers model, its library's pipeline plan
(tasks.train.parallel.hf_stages), returning the module of stage `stage` of `stages`: the
blocks it owns, in order, the first stage with the input layers, the last with the output
layers, its submodules named as in the whole model (so a checkpoint's keys are the whole
model's, and a checkpoint written with stages loads without them, torchtitan's way). It may
raise ConfigError when its layers do not divide. A model without one under pp above 1:
ConfigError before training starts.

The step (`PipelineStep`): every rank of a pipeline takes the same batch (its data-parallel
rank's, tasks.train.parallel.mesh); the first stage feeds the inputs, the last computes the
loss; the batch is split into train.parallel.pp_microbatches micro-batches of equal size that
the 1F1B schedule (torch's Schedule1F1B) runs forward and backward through the stages. Each
micro-batch's loss is divided by the number of micro-batches (and of accumulated batches), so
the gradients, summed over them, are those of the whole batch's mean loss. FSDP2 shards each
stage over the data-parallel dimensions as without stages (tasks.train.sharding); the schedule
reduce-scatters the stage's gradients once, after the last micro-batch.

The schedule's stages receive activations into buffers of the first step's shapes: every
batch of a pipelined run is whole (the last partial batch of an epoch is dropped, as under CUDA
graphs). Evaluation takes batches of any size: `forward` passes one batch through the stages
with plain point-to-point sends (no backward, nothing to schedule), its shape sent first.
"""

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.errors import ConfigError
from trainflow.tasks.objectives import Objective
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.outputs import is_transformers_model, logits_of
from trainflow.tasks.train.parallel.layout import mesh_shape, microbatches
from trainflow.tasks.train.parallel.mesh import pipeline_mesh

if TYPE_CHECKING:
    from collections.abc import Iterable

    from trainflow.cluster.heartbeat import Heartbeat
    from trainflow.tasks.train.precision import PrecisionPolicy

SPLIT_METHOD = "pp_split"
"""The method by which a model names its pipeline stages."""


def stage_module(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage `stage` of `stages` of `model` (its `pp_split`); ConfigError (one line) when it
    has none, when the method raises ConfigError (layers that do not divide), or when what it
    returns holds a parameter the model does not (under another name)."""
    method = getattr(model, SPLIT_METHOD, None)
    if method is None and is_transformers_model(model):
        from trainflow.tasks.train.parallel.hf_stages import hf_stage

        method = functools.partial(hf_stage, model)  # the library's plan (its pp_plan)
    if method is None:
        raise ConfigError(
            f"train.parallel.pp={stages}: the model {type(model).__name__} names no pipeline "
            f"stages: give it a method {SPLIT_METHOD}(self, stage, stages) returning the module "
            "of one stage (docs/training.md, Parallelism), use train.model=transformer or a "
            "Hugging Face llama (train.model=hf), or set train.parallel.pp=1"
        )
    part = method(stage, stages)
    whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    mine = [*part.named_parameters(), *part.named_buffers()]
    strays = [n for n, t in mine if whole.get(n) is not t]
    if strays:
        raise ConfigError(
            f"{type(model).__name__}.{SPLIT_METHOD}({stage}, {stages}) returned tensors "
            f"{strays[:3]} that the model does not hold under those names: keep each "
            "submodule's name in the whole model (checkpoints are keyed by it)"
        )
    return part


def check_stages(model: nn.Module, stages: int) -> None:
    """ConfigError (one line) unless `model` cuts into `stages` stages (stage_module) that
    hold each of its parameters exactly once: one left out would not train, one held twice
    would train apart in two stages. The preflight's check, on the meta device."""
    held: dict[str, int] = {}
    for stage in range(stages):
        for name, _ in stage_module(model, stage, stages).named_parameters():
            held[name] = held.get(name, 0) + 1
    wrong = [n for n, _ in model.named_parameters() if held.get(n, 0) != 1]
    if wrong:
        count = held.get(wrong[0], 0)
        raise ConfigError(
            f"{type(model).__name__}.{SPLIT_METHOD}(stage, {stages}) puts {wrong[0]} in "
            f"{count} of the {stages} stages: every parameter belongs to exactly one stage"
        )


def this_stage(model: nn.Module, ctx: DistContext) -> nn.Module:
    """The stage of `model` this rank holds (its place on the mesh's `pp` dimension), or
    `model` itself without stages."""
    mesh = pipeline_mesh(ctx.mesh)
    if mesh is None:
        return model
    return stage_module(model, mesh.get_local_rank(), ctx.pp)


def pipeline_step(
    module: nn.Module, ctx: DistContext, cfg: TrainConfig, objective: Objective, accumulation: int
) -> "PipelineStep | None":
    """The step of this rank's stage `module` (wrapped or sharded as it trains) under
    train.parallel.pp, None without stages. ConfigError when train.batch_size does not split
    into the micro-batches (every rank says so at once)."""
    if ctx.pp == 1:
        return None
    n = microbatches(cfg.parallel, mesh_shape(cfg.parallel, ctx.world_size))
    if n < ctx.pp:  # pp=-1 resolved to more stages than the micro-batches set
        raise ConfigError(
            f"train.parallel.pp_microbatches={n} is fewer than this job's {ctx.pp} stages "
            "(the 1F1B schedule needs one in flight per stage): set it to pp or more"
        )
    if cfg.batch_size % n:
        raise ConfigError(
            f"train.batch_size={cfg.batch_size} does not split into train.parallel."
            f"pp_microbatches={n} equal micro-batches: set train.batch_size to a multiple of {n}"
        )
    return PipelineStep(module, ctx, objective, n, accumulation)


class PipelineStep:
    """The forward and backward passes of one rank's stage under the 1F1B schedule, and
    evaluation's forward through the stages (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        ctx: DistContext,
        objective: Objective,
        microbatches: int,
        accumulation: int = 1,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        mesh = pipeline_mesh(ctx.mesh)
        assert mesh is not None, "a pipeline step without a pp dimension"
        self.group = mesh.get_group()
        """This rank's pipeline: the ranks holding the other stages (its gradient norm is
        summed over them)."""
        self.stage, self.stages = mesh.get_local_rank(), ctx.pp
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.microbatches = microbatches
        self.objective, self.device = objective, ctx.device
        self._module = module
        divide = microbatches * accumulation

        def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            return objective.loss(logits_of(output), target) / divide

        stage = PipelineStage(module, self.stage, self.stages, ctx.device, group=self.group)
        # scale_grads=False: the loss is divided above, once, for micro-batches and accumulation
        self._schedule = Schedule1F1B(stage, microbatches, loss_fn=loss, scale_grads=False)

    def accumulate(
        self,
        batches: "Iterable[tuple[torch.Tensor, torch.Tensor]]",
        policy: "PrecisionPolicy",
        heartbeat: "Heartbeat",
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward passes of the step's `batches` (train.batch_size each, split
        into micro-batches by the schedule) under `policy`'s autocast, their gradients added
        to the stage's parameters' (zeroed by the caller); returns their metric sums and
        sample count: the last stage's, zeros and 0 on the others (their sums are added over
        the stages: tasks.train.distributed). `heartbeat` is told of each batch."""
        sums = torch.zeros(self.objective.sums_size, dtype=torch.float64, device=self.device)
        count = 0
        for x, y in batches:
            # whole batches only (TrainConfig.same_shape_batches), checked by pipeline_step
            assert x.shape[0] % self.microbatches == 0, (x.shape, self.microbatches)
            heartbeat.beat("backward")
            inputs = (x,) if self.first else ()
            with policy.autocast():
                output = self._schedule.step(*inputs, target=y if self.last else None)
            if self.last:
                sums += self.objective.sums(logits_of(output).detach(), y)
                count += int(y.shape[0])
        return sums, count

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """`x` (the batch's inputs; read on the first stage only) through the stages, as one
        batch: the logits on the last stage, None on the others (collective over the
        pipeline). Each stage sends the next its output's shape and dtype, then the output."""
        if not self.first:
            source = dist.get_global_rank(self.group, self.stage - 1)
            meta: list[Any] = [None]
            dist.recv_object_list(meta, src=source, group=self.group, device=self.device)
            shape, dtype = meta[0]
            x = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(x, src=source, group=self.group)
        output = self._module(x)
        if self.last:
            return logits_of(output)
        sink = dist.get_global_rank(self.group, self.stage + 1)
        dist.send_object_list(
            [(tuple(output.shape), output.dtype)], dst=sink, group=self.group, device=self.device
        )
        dist.send(output.contiguous(), dst=sink, group=self.group)
        return None
