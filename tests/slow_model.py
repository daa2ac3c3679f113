"""A model plug-in whose training steps take at least a set time: a sleep in its forward pass
while training, which changes no number it computes (validation and test passes run at full
speed). For time-limit tests of jobs that build their own training job (a search's trials)."""

import time

import torch
from torch import nn

from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.models import reference_cnn


class _Sleepy(nn.Module):
    def __init__(self, inner: nn.Module, sleep_s: float) -> None:
        super().__init__()
        self.inner, self.sleep_s = inner, sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.sleep_s)
        out: torch.Tensor = self.inner(x)
        return out


def slow_cnn(spec: DataSpec, sleep_s: float = 0.25) -> nn.Module:
    """`reference_cnn` with `sleep_s` added to every training forward pass."""
    return _Sleepy(reference_cnn(spec), sleep_s)
