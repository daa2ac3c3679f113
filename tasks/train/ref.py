"""The reference training hands to evaluation."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class CheckpointRef(BaseModel):
    """A checkpoint file on disk and the facts about it."""

    model_config = ConfigDict(frozen=True)

    path: Path
    """The checkpoint file (weights only: the best model)."""
    sha256: str
    """Content hash of the file, checked before loading."""
    epoch: int
    """Epochs completed when it was written."""
    step: int
    """Optimiser steps completed when it was written."""
    metrics: dict[str, float]
    """Validation metrics of this checkpoint."""
    history_path: Path
    """JSON file with the per-epoch metric history of the whole run."""
    package_lock_hash: str | None = None
    """sha256 of the installed package set as rank 0 saw it (tasks.tracking.packages)."""
    test_metrics: dict[str, float] = {}
    """The job's own test pass of these weights (tasks.train.first_result); {}: none."""
