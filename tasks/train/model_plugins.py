"""Model plug-ins: `train.model` names a factory, `train.model_args` are its keyword arguments.

A factory is any callable `factory(spec: DataSpec, **model_args) -> nn.Module` (`ModelFactory`).
`train.model` is a built-in name (`BUILTIN_MODELS`), an import path `package.module:factory`,
or a name an installed package registers under the entry-point group `trainflow.models`; all
three resolve through trainflow.tasks.plugins, our built-ins included. `build_model` is the one
place a model is built (ranks, evaluation, preflight); `check_model` builds it on the meta
device and runs one forward pass there, so a wrong import, a raising factory, an output without
logits or a wrong output shape is one line before any work starts, whatever the model's size.
The forward pass may return the logits, a dict or Hugging Face ModelOutput with `logits`, or a
tuple whose first element is the logits (tasks.train.outputs).
"""

import functools
import inspect
from typing import Any, Protocol

import torch
from torch import nn

from trainflow.compat import fake_forward
from trainflow.tasks.plugins import PluginError, Resolved, call, resolve
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.outputs import OutputError, is_transformers_model, logits_of

MODEL_GROUP = "trainflow.models"
"""Entry-point group under which installed packages register model factories."""
BUILTIN_MODELS = {
    "reference_cnn": "trainflow.tasks.train.models:reference_cnn",
    "resnet": "trainflow.tasks.train.models:resnet",
    "mlp": "trainflow.tasks.train.models:mlp",
    "token_conv": "trainflow.tasks.train.models:token_conv",
    "transformer": "trainflow.tasks.train.transformer:transformer",
    "hf": "trainflow.tasks.train.hf_models:transformers_model",
    "transformers": "trainflow.tasks.train.hf_models:transformers_model",
}
"""Short names of our own factories (import paths, resolved like a user's)."""
CHECK_BATCH = 2
"""Samples in preflight's meta forward pass (2: batch norm in any mode accepts it)."""


class ModelFactory(Protocol):
    """What `train.model` names: builds the network for the data `spec` describes.

    Size the input layer from `spec.sample_shape` (and `spec.sample_dtype`: "int64" token ids
    want an embedding) and the output from `spec.output_shape(batch)`: (batch, num_classes)
    logits for classification. The forward pass returns that tensor, or a dict / ModelOutput
    holding it as `logits`, or a tuple whose first element it is (a transformers model as it
    is). `model_args` come from `train.model_args`. Build parameters on
    the current default device (no `device=` argument): preflight builds on the meta device.
    """

    def __call__(self, spec: DataSpec, **model_args: Any) -> nn.Module: ...


def resolve_factory(cfg: TrainConfig) -> Resolved:
    """The factory cfg.model names (PluginError: one line naming the module and the fix)."""
    return resolve(cfg.model, setting="train.model", group=MODEL_GROUP, builtins=BUILTIN_MODELS)


def build_model(cfg: TrainConfig, spec: DataSpec) -> nn.Module:
    """The network cfg.model's factory builds for `spec`, called with cfg's model arguments."""
    return _build(resolve_factory(cfg), cfg, spec)


def check_model(cfg: TrainConfig, spec: DataSpec) -> ModelReport:
    """Build cfg's model on the meta device (no weights allocated) and check one forward pass
    of CHECK_BATCH samples gives spec.output_shape; PluginError (one line) otherwise."""
    return checked_model(cfg, spec)[0]


def checked_model(cfg: TrainConfig, spec: DataSpec) -> tuple[ModelReport, nn.Module]:
    """check_model's report and the meta-device model it checked (for the checks that need
    a model, so that the user's factory runs once)."""
    factory = resolve_factory(cfg)
    with torch.device("meta"):
        model = _build(factory, cfg, spec)
        dtype = getattr(torch, spec.sample_dtype)
        batch = torch.empty((CHECK_BATCH, *spec.sample_shape), dtype=dtype)
        run = functools.partial(fake_forward, model) if is_transformers_model(model) else model
        forward = Resolved(obj=run, target=factory.target, file=factory.file)
        model.eval()
        out = call(forward, f"the forward pass of the model {cfg.model!r}", batch)
    if cfg.strategy == "fsdp":  # (imports FSDP, ~0.6 s of a flow's start: only for it)
        from trainflow.tasks.train.sharding import sharding_units

        sharding_units(model)  # a model's own shard_units() that names strangers: one line
    need = spec.output_shape(CHECK_BATCH)
    try:
        logits = logits_of(out)
    except OutputError as err:
        raise PluginError(
            f"train.model={cfg.model!r}: the forward pass of the model built by {factory.file} "
            f"{err} of shape {need} ({_needs(spec)})"
        ) from None
    if tuple(logits.shape) != need:
        raise PluginError(
            f"train.model={cfg.model!r}: the model built by {factory.file} gives "
            f"{tuple(logits.shape)} for a batch of {CHECK_BATCH} samples of shape "
            f"{spec.sample_shape}; {_needs(spec)} needs a tensor of shape {need}: fix the "
            "model's output layer"
        )
    params = list(model.parameters())
    report = ModelReport(
        target=factory.target,
        file=factory.file,
        parameters=sum(p.numel() for p in params),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
    )
    return report, model


def _build(factory: Resolved, cfg: TrainConfig, spec: DataSpec) -> nn.Module:
    """factory(spec, **arguments); PluginError when it raises or returns no nn.Module."""
    model = call(factory, f"the model factory {cfg.model!r}", spec, **_arguments(factory, cfg))
    if not isinstance(model, nn.Module):
        raise PluginError(
            f"train.model={cfg.model!r}: the factory in {factory.file} returned "
            f"{describe_type(model)}, not a torch.nn.Module: return the network"
        )
    return model


def _arguments(factory: Resolved, cfg: TrainConfig) -> dict[str, Any]:
    """cfg.model_args, plus cfg.width (its shorthand) for a factory with a `width` argument."""
    args = dict(cfg.model_args)
    if cfg.width is not None and "width" not in args and _takes(factory.obj, "width"):
        args["width"] = cfg.width
    return args


def _takes(obj: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): pass model_args only
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _needs(spec: DataSpec) -> str:
    """'classification with 10 classes' and the like."""
    if spec.objective == "regression":
        return f"regression of targets shaped {spec.target_shape}"
    what = "classes" if spec.objective == "classification" else "tokens"
    return f"{spec.objective} with {spec.num_classes} {what}"


def describe_type(value: object) -> str:
    """'a tuple', 'None' and the like."""
    return "None" if value is None else f"a {type(value).__name__}"
