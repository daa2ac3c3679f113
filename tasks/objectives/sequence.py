"""sequence: an integer class per position (next-token language modelling, tagging)."""

import math
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from trainflow.errors import DataError
from trainflow.tasks.objectives import Report
from trainflow.tasks.spec import DataSpec


class Sequence:
    """Per-position cross-entropy over (batch, T, vocabulary) logits (a causal language model's
    `logits`, as transformers' ModelOutput holds them): position t's logits are scored against
    target t, the next token (the source shifts the targets, not the objective); token accuracy
    and perplexity."""

    select = "loss"
    headline = "perplexity"
    sums_size = 3  # summed token cross-entropy, correct tokens, tokens

    def __init__(self, spec: DataSpec) -> None:
        """No options."""
        self.spec = spec

    def check(self, spec: DataSpec) -> None:
        """Integer targets with a time axis, and a vocabulary."""
        if spec.target_dtype != "int64":
            raise DataError(
                f"train.objective=sequence needs integer ids per position, but the targets are "
                f"{spec.target_dtype}: set train.objective=regression for float targets"
            )
        if len(spec.target_shape) < 1:
            raise DataError(
                "train.objective=sequence needs targets with a time axis (n, T), but each "
                "target is one integer: set train.objective=classification, or return targets "
                "of shape (n, T) from the source"
            )
        if (spec.num_classes or 0) < 2:
            raise DataError("train.objective=sequence needs a vocabulary of at least 2 ids")

    def _flat(
        self, output: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return output.reshape(-1, output.shape[-1]), target.reshape(-1)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every position."""
        logits, ids = self._flat(output, target)
        return F.cross_entropy(logits, ids)

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[summed cross-entropy, correct tokens, tokens]."""
        logits, ids = self._flat(output, target)
        loss = F.cross_entropy(logits.float(), ids, reduction="sum")
        correct = (logits.argmax(dim=1) == ids).sum()
        count = torch.full((), float(ids.numel()), device=output.device)  # no host copy
        return torch.stack([loss.double(), correct.double(), count.double()])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """loss (per token), token_accuracy, perplexity (exp of the loss)."""
        loss, correct, count = sums
        mean = loss / max(count, 1)
        return {
            "loss": mean,
            "token_accuracy": correct / max(count, 1),
            "perplexity": math.exp(min(mean, 700.0)),
        }

    def higher_is_better(self, metric: str) -> bool:
        """Token accuracy only; loss and perplexity are better lower."""
        return "accuracy" in metric

    def report(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], classes: list[str]
    ) -> Report:
        """Test metrics and token accuracy per position (JSON and figure)."""
        from trainflow.tasks.objectives import plots

        total = torch.zeros(self.sums_size, dtype=torch.float64)
        hits = np.zeros(math.prod(self.spec.target_shape))
        seen = 0
        for output, target in batches:
            total += self.sums(output, target).cpu()
            right = (output.argmax(dim=-1) == target).reshape(len(target), -1)
            hits += right.sum(0).numpy()
            seen += len(target)
        per_position = (hits / max(seen, 1)).tolist()
        metrics = {f"test_{k}": v for k, v in self.metrics(total.tolist()).items()}
        return Report(
            metrics=metrics,
            figures={"token_accuracy_by_position.png": plots.per_position_figure(per_position)},
            documents={"token_accuracy_by_position.json": per_position},
        )
