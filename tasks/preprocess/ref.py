"""The reference a preprocessing run hands to training and evaluation."""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainflow.tasks.spec import DataSpec, ObjectiveName

Normalisation = Literal["per_channel", "per_feature", "none"]


class DatasetRef(BaseModel):
    """A written dataset: folder of shards plus manifest.json, and the facts stages need."""

    model_config = ConfigDict(frozen=True)

    path: Path
    """Folder holding the shards and manifest.json."""
    content_hash: str
    """sha256 over the manifest's shard hashes: identifies the dataset's bytes."""
    counts: dict[str, int]
    """Samples per split: train, val, test."""
    shape: tuple[int, ...]
    """Shape of one input sample: (C, H, W) images, (F,) features, (T,) token ids."""
    classes: list[str]
    """Class names (label i is classes[i]); empty where targets are floats or per-position
    token ids without names."""
    mean: list[float]
    """Per-channel (or per-feature) mean of the raw train split; empty when normalisation is
    none."""
    std: list[float]
    """Per-channel (or per-feature) standard deviation of the raw train split."""
    cache_key: str
    """Fingerprint of the raw data plus the preprocessing config."""
    sample_dtype: str = "uint8"
    """dtype of the stored inputs: uint8 pixels, float32 values, int64 token ids."""
    target_shape: tuple[int, ...] = ()
    """Shape of one target: () for a class or a scalar, (k,) outputs, (T,) per position."""
    target_dtype: str = "int64"
    """int64 (classes, token ids) or float32 (regression targets)."""
    num_classes: int | None = None
    """Number of classes, or the vocabulary size of token data; None for float targets."""
    normalisation: Normalisation = "per_channel"
    """What readers apply at batch time: per_channel (images: axis 1 of (C, H, W)),
    per_feature (features (F,)) or none (token ids)."""

    @property
    def n_classes(self) -> int | None:
        """num_classes, or the number of class names (datasets written before it existed)."""
        return self.num_classes if self.num_classes is not None else len(self.classes) or None


def dataset_spec(ref: DatasetRef, objective: ObjectiveName | str) -> DataSpec:
    """What a model factory and an objective are told about this dataset.

    The model receives float32 (normalised) inputs, or int64 token ids where the dataset is not
    normalised. `objective` is train.objective (a plug-in's name is passed on as it is).
    """
    return DataSpec(
        sample_shape=tuple(ref.shape),
        sample_dtype="int64" if ref.normalisation == "none" else "float32",
        objective=objective,  # type: ignore[arg-type]
        num_classes=ref.n_classes if ref.target_dtype == "int64" else None,
        target_shape=tuple(ref.target_shape),
        target_dtype=ref.target_dtype,
    )
