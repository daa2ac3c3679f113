"""Objectives: what a model is trained for, and everything that follows from it.

`train.objective` names one: `classification`, `regression`, `sequence` (built in, registered
below like a user's), an import path `package.module:MyObjective`, or a name an installed package
registers under the entry-point group `trainflow.objectives`. It is built as
`Objective(spec, **train.objective_args)` and gives the loss, the metrics streamed over
training, validation and test batches (as sums, so ranks add them with one all_reduce), the
evaluate stage's artifacts, which metric picks the best checkpoint and the champion, in which
direction, and a check of the data against the objective, run at preflight.

Takes a `DataSpec` (tasks.spec: what the data looks like); hands the train stage its loss and
metric sums and the evaluate stage its report.

Modules:
    __init__        the Objective protocol, its registry (make_objective) and helpers.
    classification  one class per sample: cross-entropy, accuracy, a confusion matrix.
    regression      float targets of any shape: MSE or L1; MAE, RMSE and R² per output.
    sequence        an integer class per position: token accuracy and perplexity.
    metrics         accuracy, confusion matrix and per-class precision, recall and F1.
    plots           confusion matrix, training curves, predicted vs true, residuals.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainflow.tasks import plugins
from trainflow.tasks.spec import DataSpec

if TYPE_CHECKING:  # matplotlib: imported only where figures are drawn
    from matplotlib.figure import Figure

GROUP = "trainflow.objectives"
BUILTINS = {
    "classification": "trainflow.tasks.objectives.classification:Classification",
    "regression": "trainflow.tasks.objectives.regression:Regression",
    "sequence": "trainflow.tasks.objectives.sequence:Sequence",
}


@dataclass
class Report:
    """What the evaluate stage logs for the test split."""

    metrics: dict[str, float]
    """Flat MLflow metric names, each starting with `test_`."""
    figures: "dict[str, Figure]" = field(default_factory=dict)
    """Artifact file name (.png) -> figure."""
    documents: dict[str, Any] = field(default_factory=dict)
    """Artifact file name (.json) -> JSON-able content."""


class Objective(Protocol):
    """An objective, built as `Objective(spec, **train.objective_args)`.

    Metric names carry no split: training logs them as train_<name>, val_<name> and
    test_<name>.
    """

    select: str
    """Validation metric that picks the best checkpoint (e.g. "accuracy", "loss")."""
    headline: str
    """Test metric the run is summarised by and the champion is chosen on by default."""

    def check(self, spec: DataSpec) -> None:
        """Raise DataError (one line with the fix) when the data does not fit the objective."""
        ...

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch (a scalar the optimiser steps on). `output` is always a tensor:
        what the model returned, or its `logits` entry (a ModelOutput or dict) or first element
        (a tuple), read by trainflow.tasks.train.outputs.logits_of."""
        ...

    def sums(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """float64 vector of sums over the batch (same length every batch): the metrics of
        many batches and ranks are `metrics` of their summed vectors."""
        ...

    @property
    def sums_size(self) -> int:
        """Length of `sums`."""
        ...

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """Metrics (loss first) from summed `sums` vectors."""
        ...

    def higher_is_better(self, metric: str) -> bool:
        """Direction of a metric name (with or without its split prefix)."""
        ...

    def report(
        self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], classes: list[str]
    ) -> Report:
        """Test metrics and artifacts from the test split's (output, target) batches;
        `classes`: the dataset's class names (may be empty)."""
        ...


def make_objective(name: str, spec: DataSpec, args: dict[str, Any] | None = None) -> Objective:
    """The objective `name` (train.objective) built for `spec` with `args`."""
    resolved = plugins.resolve(name, setting="train.objective", group=GROUP, builtins=BUILTINS)
    objective: Objective = plugins.call(resolved, f"the objective {name!r}", spec, **(args or {}))
    return objective


def is_better(objective: Objective, metric: str, value: float, than: float) -> bool:
    """True when `value` of `metric` strictly beats `than` in the objective's direction."""
    return value > than if objective.higher_is_better(metric) else value < than


def split_free(metric: str) -> str:
    """`val_loss` -> `loss`."""
    for prefix in ("train_", "val_", "test_"):
        if metric.startswith(prefix):
            return metric[len(prefix) :]
    return metric


def check_data(name: str, args: dict[str, Any], spec: DataSpec) -> Objective:
    """The objective, built for `spec`, after its check of the data (DataError: one line
    with the fix); run at preflight, before any work."""
    objective = make_objective(name, spec, args)
    objective.check(spec)
    return objective
