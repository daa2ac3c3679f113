"""Config of the evaluation stage."""

from pydantic import Field

from tasks.base import StrictModel


class EvaluateConfig(StrictModel):
    """How the best checkpoint is evaluated and logged."""

    batch_size: int = Field(512, ge=1, le=65_536)
    """Samples per inference batch."""
    log_model: bool = True
    """Log the model to MLflow with signature, input example and pip requirements."""
    min_accuracy: float | None = Field(None, ge=0.0, le=1.0)
    """Fail the pipeline when test accuracy is below this (None: never fail)."""
