"""Tensor parallelism: a model's layers split over the mesh's `tp` dimension by a plan.

A plan maps submodule names (fnmatch patterns: ``layers.*.attention.wq``) to parallel styles:
ColwiseParallel splits a linear layer's outputs (attention's query/key/value, the MLP's first
layer), RowwiseParallel its inputs (the projections back to the model width), SequenceParallel
runs a norm on this rank's part of the sequence, PrepareModuleInput gathers the sequence where
a block needs all of it. Where a model gets its plan (`how_to_split`), in this order:
- its own method ``tp_plan(self, tp: int) -> dict[str, ParallelStyle]`` of torch's styles
  (torch.distributed.tensor.parallel; the built-in `transformer` has one, a user's model names
  its plan the same way), which may raise ConfigError when its sizes do not divide by `tp`
  (its heads, hidden width, vocabulary); applied with torch's `parallelize_module`;
- a Hugging Face `transformers` model: the library's own plan for its architecture, applied
  with transformers' own styles (tasks.train.parallel.hf_plan; Llama-style decoders have one,
  GPT-2 and BERT none);
- otherwise no plan: ConfigError before anything is queued.
`check_tp` runs the same choice and checks on the meta-device model preflight builds.

Every rank of a tp group takes the same batch (tasks.train.parallel.mesh); the plan's last
style gathers the logits, so the loss and the metrics are those of the whole model on every
rank of the group.
"""

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from torch import nn

from trainflow.errors import ConfigError
from trainflow.tasks.train.outputs import is_transformers_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PLAN_METHOD = "tp_plan"
"""The method by which a model names its tensor-parallel plan."""


@dataclass(frozen=True)
class Split:
    """How a model's layers are split over a `tp` mesh: the plan, whose it is, and the
    function that applies it (in place, no collective) given the model and the mesh."""

    plan: dict[str, Any]
    source: str
    apply: Callable[[nn.Module, "DeviceMesh"], nn.Module]


def how_to_split(model: nn.Module, tp: int) -> Split:
    """`model`'s split over `tp` ranks: by its own `tp_plan(tp)` method, else (a transformers
    model) by the library's plan for its architecture; ConfigError (one line) when it has
    none or the plan does not fit the model's sizes."""
    method = getattr(model, PLAN_METHOD, None)
    if callable(method):  # (a transformers model's `tp_plan` is a property: its plan's dict)
        plan = own_plan(model, tp)

        def parallelize(m: nn.Module, mesh: "DeviceMesh") -> nn.Module:
            from torch.distributed.tensor.parallel import parallelize_module

            return parallelize_module(m, mesh, plan, src_data_rank=None)

        return Split(plan, f"{type(model).__name__}.{PLAN_METHOD}({tp})", parallelize)
    from trainflow.tasks.train.parallel.hf_stages import is_hf_stage

    if is_transformers_model(model) or is_hf_stage(model):  # a model, or its pipeline stage
        from trainflow.tasks.train.parallel.hf_plan import apply_hf, check_hf

        spelled = check_hf(model, tp)
        return Split(spelled, "transformers", lambda m, mesh: apply_hf(m, mesh, spelled))
    raise ConfigError(
        f"train.parallel.tp={tp}: the model {type(model).__name__} has no tensor-parallel "
        f"plan: give it a method {PLAN_METHOD}(self, tp) returning its layers' parallel "
        "styles (docs/training.md, Parallelism), use train.model=transformer or a Hugging Face "
        "architecture with a plan (train.model=hf, e.g. llama), or set train.parallel.tp=1"
    )


def check_tp(model: nn.Module, tp: int) -> None:
    """ConfigError (one line) when `model` cannot be split over `tp` ranks: no plan, or sizes
    its plan needs divisible by `tp` that are not. Nothing for tp=1. Works on the meta-device
    model preflight builds (tasks.train.model_plugins.checked_model)."""
    if tp != 1:
        how_to_split(model, tp)


def tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """`model`'s plan for `tp` ranks (how_to_split): torch's styles by submodule pattern for a
    model's own plan, transformers' style names by module and parameter for the library's."""
    return how_to_split(model, tp).plan


def own_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """The plan `model.tp_plan(tp)` returns; ConfigError (one line) when that raises
    ConfigError (sizes that do not divide) or a pattern of the plan names no submodule."""
    plan = dict(getattr(model, PLAN_METHOD)(tp))
    names = [name for name, _ in model.named_modules()]
    strays = [p for p in plan if not any(fnmatchcase(n, p) for n in names)]
    if strays:
        raise ConfigError(
            f"{type(model).__name__}.{PLAN_METHOD}({tp}) names {strays}, which match no "
            "submodule of the model: name its submodules as model.named_modules() does"
        )
    return plan


def split_layers(model: nn.Module, tp_mesh: "DeviceMesh", tp: int) -> nn.Module:
    """`model` with its plan (how_to_split) applied over `tp_mesh` (in place). No collective:
    every rank splits its own copy; the weights are then filled from rank 0
    (tasks.train.sharded_init)."""
    _quiet_notes()
    return how_to_split(model, tp).apply(model, tp_mesh)


def _quiet_notes() -> None:
    """Keep two of torch's notes to its own developers off the job's log (torch 2.13):
    DTensor's advice to flatten mesh dimensions, logged as a warning where the gradient norm
    all-reduces over tp and dp_shard one after the other and where a full state dict is
    gathered (DeviceMesh's flatten is private); and FSDP2's warning that the root returns a
    view (the gathered logits), which matters only to an in-place change of the output, which
    the loop never makes."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
