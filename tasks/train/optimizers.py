"""The optimizer: AdamW, SGD or a user's plug-in, and which parameters decay.

`train.optimizer` resolves as `train.model` does (trainflow.tasks.plugins): a built-in name
(adamw, sgd: `BUILTIN_OPTIMIZERS`), an import path `package.module:factory`, or an entry point
of the group `trainflow.optimizers`. A factory is called as
`factory(param_groups, lr=train.lr, **args)` (`OptimizerFactory`) and returns a
torch.optim.Optimizer; its state is checkpointed, and resharded under FSDP, as AdamW's is, as
long as it is kept per parameter in `optimizer.state` (torch's convention).
`check_optimizer` builds it over the model built on the meta device before anything is
queued, so a wrong import, a raising factory or a wrong return is one line.

Weight decay pulls weights towards 0. On a bias, a norm's scale or shift, or an embedding
row it only shrinks what the model needs unshrunk (a norm's scale towards 0, a rare token's
embedding towards the origin), so by default these go into a second parameter group with no
decay, as in GPT-2/nanoGPT, BERT and Hugging Face's Trainer (biases and norms) and torchtune.
A parameter is exempt when it has fewer than 2 dimensions (biases, norm weights, scalars) or
belongs to an `nn.Embedding` (tied output weights included: they are the embedding's). Each
group carries its `weight_decay`; a plug-in without weight decay ignores it.
"""

from typing import Any, Protocol

import torch
from torch import nn

from trainflow.tasks.plugins import PluginError, Resolved, call, resolve
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import ADAM_KEYS, TrainConfig
from trainflow.tasks.train.model_plugins import build_model, describe_type

# Devices with fused AdamW/SGD kernels in torch >= 2.4.
_FUSED_DEVICES = {"cuda", "cpu"}
ADAM_DEFAULTS = dict(zip(ADAM_KEYS, (0.9, 0.999, 1e-8), strict=True))
"""torch's AdamW defaults, used where train.adam_* is unset."""
SGD_MOMENTUM = 0.9
"""train.momentum when unset."""
OPTIMIZER_GROUP = "trainflow.optimizers"
"""Entry-point group under which installed packages register optimizer factories."""
BUILTIN_OPTIMIZERS = {
    "adamw": "trainflow.tasks.train.optimizers:adamw",
    "sgd": "trainflow.tasks.train.optimizers:sgd",
}
"""Short names of our own factories (import paths, resolved like a user's)."""


class OptimizerFactory(Protocol):
    """What a plug-in `train.optimizer` names: an optimizer over `params` (parameter groups,
    each a dict with "params" and "weight_decay"), at learning rate `lr` (the loop sets each
    group's "lr" every step: the schedule), with train.optimizer_args as keyword arguments.
    A torch.optim.Optimizer subclass is such a factory."""

    def __call__(
        self, params: list[dict[str, Any]], lr: float, **optimizer_args: Any
    ) -> torch.optim.Optimizer: ...


def resolve_optimizer(cfg: TrainConfig) -> Resolved:
    """The factory cfg.optimizer names (PluginError: one line naming the module and the fix)."""
    return resolve(
        cfg.optimizer,
        setting="train.optimizer",
        group=OPTIMIZER_GROUP,
        builtins=BUILTIN_OPTIMIZERS,
    )


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """cfg.optimizer over `model`'s parameters (this rank's shards under FSDP: build it after
    sharding), with the config's learning rate and weight decay and the optimizer's own
    settings (train keys for adamw and sgd, train.optimizer_args for a plug-in)."""
    groups = param_groups(model, cfg.weight_decay, cfg.weight_decay_all)
    factory = resolve_optimizer(cfg)
    args = _builtin_args(cfg) if cfg.optimizer in BUILTIN_OPTIMIZERS else cfg.optimizer_args
    what = f"the optimizer factory {cfg.optimizer!r}"
    optimizer = call(factory, what, groups, lr=cfg.lr, **args)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PluginError(
            f"train.optimizer={cfg.optimizer!r}: the factory in {factory.file} returned "
            f"{describe_type(optimizer)}, not a torch.optim.Optimizer: return the optimizer"
        )
    return optimizer


def check_optimizer(cfg: TrainConfig, spec: DataSpec, model: nn.Module | None = None) -> Resolved:
    """Build cfg's optimizer over cfg's model on the meta device (nothing allocated: `model`,
    one already built there, else built now); PluginError (one line) when it cannot be; the
    factory it resolved to."""
    with torch.device("meta"):
        make_optimizer(cfg, model if model is not None else build_model(cfg, spec))
    return resolve_optimizer(cfg)


def adamw(
    params: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """torch.optim.AdamW, fused (one kernel for all parameters) where torch has such kernels:
    CUDA, and CPU since torch 2.4 (AdamW step here: 200 -> 64 us). Under fp16 a fused
    optimizer also lets the GradScaler skip inf/nan steps on the device instead of syncing
    every step."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, fused=_fused(params))


def sgd(
    params: list[dict[str, Any]], lr: float, momentum: float, nesterov: bool
) -> torch.optim.Optimizer:
    """torch.optim.SGD, fused where torch has the kernels (as adamw), but not over FSDP's
    sharded parameters: DTensor has no sharding rule for fused SGD (torch 2.13: "Operator
    aten._fused_sgd_.default does not have a sharding strategy registered" at the first
    step), where it has one for fused AdamW."""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for g in params for p in g["params"])
    fused = None if sharded else _fused(params)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, fused=fused)


def _builtin_args(cfg: TrainConfig) -> dict[str, Any]:
    """adamw's or sgd's keyword arguments from their train keys, defaults where unset."""
    if cfg.optimizer == "sgd":
        momentum = SGD_MOMENTUM if cfg.momentum is None else cfg.momentum
        return {"momentum": momentum, "nesterov": cfg.nesterov}
    beta1, beta2, eps = (
        ADAM_DEFAULTS[k] if getattr(cfg, k) is None else getattr(cfg, k) for k in ADAM_KEYS
    )
    return {"betas": (beta1, beta2), "eps": eps}


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, in `model.parameters()` order: those that decay
    (`weight_decay`), then the exempt ones (0); one group of all when `decay_all` or there is
    no decay. A group with no parameter is left out."""
    params = list(model.parameters())
    if decay_all or weight_decay == 0:
        return [{"params": params, "weight_decay": weight_decay}]
    exempt = exempt_from_decay(model)
    groups = [
        {"params": [p for p in params if id(p) not in exempt], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def exempt_from_decay(model: nn.Module) -> set[int]:
    """ids of the parameters that do not decay: fewer than 2 dimensions, or an embedding's."""
    exempt = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.ndim < 2 or isinstance(module, nn.Embedding | nn.EmbeddingBag):
                exempt.add(id(p))
    return exempt


def _fused(groups: list[dict[str, Any]]) -> bool | None:
    """True when every parameter sits on a device with fused optimizer kernels, else None
    (torch's default: foreach on CUDA, a per-parameter loop elsewhere)."""
    devices = {p.device.type for g in groups for p in g["params"]}
    return True if devices and devices <= _FUSED_DEVICES else None
