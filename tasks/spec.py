"""What every stage and every plug-in is told about the data: one small type, `DataSpec`.

A model factory receives it (and sizes its input and output layers from it), an objective checks
the model's output against it, and the dataset reference carries the facts it is built from.
"""

from dataclasses import dataclass
from typing import Literal

ObjectiveName = Literal["classification", "regression", "sequence"]
OBJECTIVES: tuple[ObjectiveName, ...] = ("classification", "regression", "sequence")


@dataclass(frozen=True)
class DataSpec:
    """The data a model is built for.

    Examples: MNIST classification is sample_shape (1, 28, 28), sample_dtype "float32",
    objective "classification", num_classes 10, target_shape (); a tabular regression with 8
    features and one target is (8,), "float32", "regression", None, (); a character language
    model over windows of 128 tokens is (128,), "int64", "sequence", vocabulary size, (128,).
    """

    sample_shape: tuple[int, ...]
    """Shape of one input sample, without the batch dimension: (C, H, W), (F,), (T,)..."""
    sample_dtype: str
    """dtype the model receives: "float32" (images, features: normalised) or "int64" (token
    ids, never normalised)."""
    objective: ObjectiveName
    """classification, regression or sequence (see trainflow.tasks.objectives)."""
    num_classes: int | None
    """classification: number of classes; sequence: vocabulary size; regression: None."""
    target_shape: tuple[int, ...]
    """Shape of one target: () for a class or a scalar, (k,) for k regression outputs, (T,) for
    per-position classes."""
    target_dtype: str = "int64"
    """dtype of the targets as stored: "int64" (classes, ids per position) or "float32"
    (values): what an objective checks the data against."""

    def output_shape(self, batch: int) -> tuple[int, ...]:
        """The shape a model's output must have for a batch of `batch` samples."""
        if self.objective == "classification":
            return (batch, int(self.num_classes or 0))
        if self.objective == "sequence":
            return (batch, *self.target_shape, int(self.num_classes or 0))
        return (batch, *self.target_shape)


def image_classification(shape: tuple[int, ...], num_classes: int) -> DataSpec:
    """The DataSpec of float images of `shape` (C, H, W) in `num_classes` classes."""
    return DataSpec(
        sample_shape=tuple(shape),
        sample_dtype="float32",
        objective="classification",
        num_classes=num_classes,
        target_shape=(),
    )
