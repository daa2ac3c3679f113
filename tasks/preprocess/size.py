"""Roughly how much disk a preprocessed dataset takes, for a full disk's error message."""

import math
from pathlib import Path

from trainflow.tasks.preprocess.config import PreprocessConfig

_MNIST = (5000, 1 * 28 * 28)


def dataset_bytes(cfg: PreprocessConfig) -> int | None:
    """float32 images plus int64 labels for the generated and bundled sources; for files, the
    size of the source files (a lower bound: decoded images are larger); None if unknown."""
    if cfg.source == "synthetic":
        return cfg.synthetic_samples * (4 * math.prod(cfg.synthetic_shape) + 8)
    if cfg.source == "mnist":
        n, pixels = _MNIST
        return n * (4 * pixels + 8)
    return _tree_bytes(cfg.path) if cfg.path else None


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
