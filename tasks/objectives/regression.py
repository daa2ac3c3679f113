"""regression: float targets of any shape; MSE or L1; MAE, RMSE and R² per output."""

import math
from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from trainflow.errors import DataError
from trainflow.tasks.objectives import Report
from trainflow.tasks.plugins import PluginError
from trainflow.tasks.spec import DataSpec

PLOT_POINTS = 20_000
"""(predicted, true) pairs kept for the test figures: enough to see, bounded in memory."""
MAX_NAMED_OUTPUTS = 32
"""Outputs up to this many get their own metrics (mae_<i>, rmse_<i>, r2_<i>)."""


class Regression:
    """Mean squared (or absolute) error over outputs of shape (batch, *target_shape)."""

    select = "loss"
    headline = "r2"

    def __init__(self, spec: DataSpec, loss: Literal["mse", "l1"] = "mse") -> None:
        """`loss`: mse (default) or l1, the training loss (every metric is logged either way)."""
        if loss not in ("mse", "l1"):
            raise PluginError(f"train.objective_args loss={loss!r}: use 'mse' or 'l1'")
        self.spec = spec
        self.kind = loss
        self.outputs = math.prod(spec.target_shape)

    def check(self, spec: DataSpec) -> None:
        """Float targets."""
        if spec.target_dtype != "float32":
            raise DataError(
                f"train.objective=regression needs float targets, but the targets are "
                f"{spec.target_dtype} (class labels or token ids?): set "
                "train.objective=classification (or sequence), or return float targets from "
                "the source"
            )

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean over every output of every sample."""
        fn = F.mse_loss if self.kind == "mse" else F.l1_loss
        return fn(output.reshape(target.shape).float(), target)

    @property
    def sums_size(self) -> int:
        """loss sum, count, then per output: |e|, e², y, y² sums."""
        return 2 + 4 * self.outputs

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Sums over the batch (float64, so R² keeps its precision over many batches)."""
        y = target.reshape(len(target), -1).double()
        err = output.reshape(y.shape).double() - y
        per_sample = (err.abs() if self.kind == "l1" else err * err).mean(dim=1)
        head = torch.stack([per_sample.sum(), torch.full_like(per_sample[0], len(y))])
        cols = torch.stack([err.abs().sum(0), (err * err).sum(0), y.sum(0), (y * y).sum(0)])
        return torch.cat([head, cols.T.reshape(-1)])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """loss, mae, rmse (over all outputs), r2 (mean over outputs), and per output."""
        loss, n = sums[0], max(sums[1], 1.0)
        cols = np.asarray(sums[2:], np.float64).reshape(self.outputs, 4)
        abs_e, sq_e, s_y, s_y2 = cols.T
        var = s_y2 - s_y * s_y / n
        r2 = np.where(var > 0, 1.0 - sq_e / np.where(var > 0, var, 1.0), 0.0)
        out = {
            "loss": loss / n,
            "mae": float(abs_e.sum() / (n * self.outputs)),
            "rmse": float(math.sqrt(sq_e.sum() / (n * self.outputs))),
            "r2": float(r2.mean()),
        }
        if 1 < self.outputs <= MAX_NAMED_OUTPUTS:
            for i in range(self.outputs):
                out[f"mae_{i}"] = float(abs_e[i] / n)
                out[f"rmse_{i}"] = float(math.sqrt(sq_e[i] / n))
                out[f"r2_{i}"] = float(r2[i])
        return out

    def higher_is_better(self, metric: str) -> bool:
        """R² only; losses and errors are better lower."""
        return "r2" in metric

    def report(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], classes: list[str]
    ) -> Report:
        """Test metrics, a predicted-vs-true plot and a residual histogram."""
        from trainflow.tasks.objectives import plots

        total = torch.zeros(self.sums_size, dtype=torch.float64)
        pred: list[np.ndarray] = []
        true: list[np.ndarray] = []
        kept = 0
        for output, target in batches:
            total += self.sums(output, target).cpu()
            if kept < PLOT_POINTS:
                pred.append(output.reshape(-1).float().numpy()[: PLOT_POINTS - kept])
                true.append(target.reshape(-1).float().numpy()[: PLOT_POINTS - kept])
                kept += len(pred[-1])
        p = np.concatenate(pred) if pred else np.zeros(0)
        t = np.concatenate(true) if true else np.zeros(0)
        metrics = {f"test_{k}": v for k, v in self.metrics(total.tolist()).items()}
        return Report(
            metrics=metrics,
            figures={
                "predicted_vs_true.png": plots.predicted_vs_true_figure(p, t),
                "residuals.png": plots.residual_figure(p - t),
            },
        )
