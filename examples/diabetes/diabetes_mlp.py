"""A user's model for the diabetes regression example: a small MLP over the 10 features.

trainflow calls `build(spec, **train.model_args)`: `spec.sample_shape` is (10,) here and
`spec.target_shape` () (one value per patient), so the output is (batch,).
"""

import math

from torch import Tensor, nn

from trainflow.tasks.spec import DataSpec


class MLP(nn.Module):
    """Features -> `depth` hidden layers of `hidden` units (GELU, dropout) -> targets."""

    def __init__(
        self, features: int, outputs: int, hidden: int, depth: int, dropout: float
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, outputs))
        self.net = nn.Sequential(*layers)
        self.squeeze = outputs == 1

    def forward(self, x: Tensor) -> Tensor:
        out = self.net(x)
        return out.squeeze(-1) if self.squeeze else out


def build(spec: DataSpec, hidden: int = 64, depth: int = 2, dropout: float = 0.1) -> nn.Module:
    """The model for `spec` (a trainflow DataSpec): one input per feature, one output per target."""
    (features,) = spec.sample_shape
    outputs = math.prod(spec.target_shape) if spec.target_shape else 1
    return MLP(features, outputs, hidden, depth, dropout)
