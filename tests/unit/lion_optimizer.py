"""A user's optimizer plug-in, as a project would write one: Lion (Chen et al. 2023, "Symbolic
Discovery of Optimization Algorithms"), a sign of an interpolated momentum, with decoupled
weight decay from each parameter group; and factories that are wrong in the ways the
preflight check must catch."""

from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """Lion: one momentum buffer (exp_avg) per parameter, kept in `self.state` as torch's
    optimizers keep theirs, so checkpoints hold and reshard it."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((exp_avg * beta1 + p.grad * (1 - beta1)).sign_(), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def returns_a_number(params: Any, lr: float) -> float:
    return lr


def raises(params: Any, lr: float) -> torch.optim.Optimizer:
    raise RuntimeError("no such optimizer")
