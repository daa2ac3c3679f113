"""classification: one class per sample; cross-entropy, accuracy, a confusion matrix."""

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from trainflow.errors import DataError
from trainflow.tasks.objectives import Report
from trainflow.tasks.objectives import metrics as class_metrics
from trainflow.tasks.spec import DataSpec


class Classification:
    """Cross-entropy over (batch, classes) logits; accuracy; per-class P/R/F1 at test."""

    select = "accuracy"
    headline = "accuracy"
    sums_size = 3  # loss sum, correct, count

    def __init__(self, spec: DataSpec) -> None:
        """No options."""
        self.spec = spec

    def check(self, spec: DataSpec) -> None:
        """Integer targets, one per sample, at least two classes."""
        if spec.target_dtype != "int64":
            raise DataError(
                f"train.objective=classification needs integer class targets, but the targets "
                f"are {spec.target_dtype}: set train.objective=regression, or return integer "
                "classes from the source"
            )
        if spec.target_shape != ():
            raise DataError(
                f"train.objective=classification needs one class per sample, but each target "
                f"has shape {spec.target_shape}: set train.objective=sequence for a class per "
                "position"
            )
        if (spec.num_classes or 0) < 2:
            raise DataError("train.objective=classification needs at least 2 classes")

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy."""
        return F.cross_entropy(output, target)

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[summed cross-entropy, correct, count]."""
        loss = F.cross_entropy(output.float(), target, reduction="sum")
        correct = (output.argmax(dim=1) == target).sum()
        count = torch.full((), float(target.shape[0]), device=output.device)  # no host copy
        return torch.stack([loss.double(), correct.double(), count.double()])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """loss, accuracy."""
        loss, correct, count = sums
        return {"loss": loss / max(count, 1), "accuracy": correct / max(count, 1)}

    def higher_is_better(self, metric: str) -> bool:
        """Everything but the loss."""
        return not metric.endswith("loss")

    def report(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], classes: list[str]
    ) -> Report:
        """Accuracy, macro F1, per-class P/R/F1, the confusion matrix (JSON and figure)."""
        from trainflow.tasks.objectives import plots

        k = int(self.spec.num_classes or len(classes))
        classes = classes or [str(i) for i in range(k)]
        cm = np.zeros((k, k), np.int64)
        for output, target in batches:
            pred = output.argmax(dim=1)
            cm += np.bincount((target * k + pred).numpy(), minlength=k * k).reshape(k, k)
        report = class_metrics.per_class_report(cm, classes)
        return Report(
            metrics=class_metrics.flat_metrics(cm, report),
            figures={"confusion_matrix.png": plots.confusion_figure(cm, classes)},
            documents={
                "confusion_matrix.json": {"classes": classes, "matrix": cm.tolist()},
                "per_class.json": {k: r.model_dump() for k, r in report.items()},
            },
        )
