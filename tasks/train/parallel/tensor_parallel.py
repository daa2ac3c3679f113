"""Tensor parallelism: a model's layers split over the mesh's `tp` dimension by a plan.

A plan maps submodule names (fnmatch patterns: ``layers.*.attention.wq``) to torch's
parallel styles (torch.distributed.tensor.parallel): ColwiseParallel splits a linear layer's
outputs (attention's query/key/value, the MLP's first layer), RowwiseParallel its inputs (the
projections back to the model width), SequenceParallel runs a norm on this rank's part of the
sequence, PrepareModuleInput gathers the sequence where a block needs all of it. Where a model
gets its plan:
- its own method ``tp_plan(self, tp: int) -> dict[str, ParallelStyle]`` (the built-in
  `transformer` has one; a user's model names its plan the same way), which may raise
  ConfigError when its sizes do not divide by `tp` (its heads, hidden width, vocabulary);
- otherwise no plan: ConfigError before anything is queued.

Every rank of a tp group takes the same batch (tasks.train.parallel.mesh); the plan's last
style gathers the logits, so the loss and the metrics are those of the whole model on every
rank of the group.
"""

import logging
import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from trainflow.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PLAN_METHOD = "tp_plan"
"""The method by which a model names its tensor-parallel plan."""


def tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """`model`'s plan for `tp` ranks (its `tp_plan(tp)`); ConfigError (one line) when it has
    none, when the method raises ConfigError (sizes that do not divide), or when a pattern of
    the plan names no submodule."""
    method = getattr(model, PLAN_METHOD, None)
    if method is None:
        raise ConfigError(
            f"train.parallel.tp={tp}: the model {type(model).__name__} has no tensor-parallel "
            f"plan: give it a method {PLAN_METHOD}(self, tp) returning its layers' parallel "
            "styles (docs/training.md, Parallelism), use train.model=transformer, or set "
            "train.parallel.tp=1"
        )
    plan = dict(method(tp))
    names = [name for name, _ in model.named_modules()]
    from fnmatch import fnmatchcase

    strays = [p for p in plan if not any(fnmatchcase(n, p) for n in names)]
    if strays:
        raise ConfigError(
            f"{type(model).__name__}.{PLAN_METHOD}({tp}) names {strays}, which match no "
            "submodule of the model: name its submodules as model.named_modules() does"
        )
    return plan


def split_layers(model: nn.Module, tp_mesh: "DeviceMesh", tp: int) -> nn.Module:
    """`model` with its plan applied over `tp_mesh` (in place). No collective: every rank
    splits its own copy (src_data_rank=None); the weights are then filled from rank 0
    (tasks.train.sharded_init)."""
    from torch.distributed.tensor.parallel import parallelize_module

    _quiet_notes()
    return parallelize_module(model, tp_mesh, tp_plan(model, tp), src_data_rank=None)


def _quiet_notes() -> None:
    """Keep two of torch's notes to its own developers off the job's log (torch 2.13):
    DTensor's advice to flatten mesh dimensions, logged as a warning where the gradient norm
    all-reduces over tp and dp_shard one after the other and where a full state dict is
    gathered (DeviceMesh's flatten is private); and FSDP2's warning that the root returns a
    view (the gathered logits), which matters only to an in-place change of the output, which
    the loop never makes."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
