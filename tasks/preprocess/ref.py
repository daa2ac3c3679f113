"""The reference a preprocessing run hands to training and evaluation."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from trainflow.tasks.spec import DataSpec


class DatasetRef(BaseModel):
    """A written dataset: folder of shards plus manifest.json, and the facts stages need."""

    model_config = ConfigDict(frozen=True)

    path: Path
    """Folder holding the shards and manifest.json."""
    content_hash: str
    """sha256 over the manifest's shard hashes: identifies the dataset's bytes."""
    counts: dict[str, int]
    """Samples per split: train, val, test."""
    shape: tuple[int, int, int]
    """(channels, height, width) of one sample."""
    classes: list[str]
    """Class names; label i is classes[i]."""
    mean: list[float]
    """Per-channel mean of the raw train split (the normalisation applied)."""
    std: list[float]
    """Per-channel standard deviation of the raw train split."""
    cache_key: str
    """Fingerprint of the raw data plus the preprocessing config."""


def dataset_spec(ref: DatasetRef) -> DataSpec:
    """What a model factory is told about a written dataset (ranks, evaluation)."""
    return DataSpec(
        sample_shape=tuple(ref.shape),
        sample_dtype="float32",
        objective="classification",
        num_classes=len(ref.classes),
        target_shape=(),
    )
