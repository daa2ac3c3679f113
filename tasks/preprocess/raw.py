"""What a source hands the preprocess stage: raw samples, before splitting and normalisation."""

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class RawData:
    """Raw samples of one source, before splitting and normalisation."""

    images: np.ndarray
    """(N, C, H, W), uint8 or float32."""
    labels: np.ndarray
    """(N,) int64, each in range(len(classes))."""
    classes: list[str]
    """Class names; label i is classes[i]."""
    num_classes: int | None = None
    """Vocabulary size of per-position integer targets (None: len(classes) or float)."""


class LazyImages(Protocol):
    """(N, C, H, W) images that stay on disk (or are generated) until a worker takes rows."""

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, C, H, W)."""
        ...

    @property
    def ndim(self) -> int:
        """Always 4."""
        ...

    def __len__(self) -> int:
        """N."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """uint8 or float32."""
        ...

    def take(self, rows: np.ndarray, xp: ModuleType = np) -> Any:
        """A new array of module xp holding those rows."""
        ...

    def first_nonfinite(self) -> int | None:
        """Index of the first sample holding NaN/inf, None when all are finite."""
        ...


class LazyTargets(Protocol):
    """Targets that stay on the workers' disks: what the client knows of them."""

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, ...)."""
        ...

    @property
    def ndim(self) -> int:
        """1 + the sample's axes."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """int64 or float32."""
        ...

    def __len__(self) -> int:
        """N."""
        ...

    def min(self) -> int:
        """The smallest target (integer targets)."""
        ...

    def max(self) -> int:
        """The largest target (integer targets)."""
        ...


@dataclass(frozen=True)
class RawSource:
    """Raw samples as the preprocess stage reads them: lazy except for in-memory sources.

    Built-in sources give images and class labels; source plug-ins any sample shape and
    targets (tasks.preprocess.plugin_source)."""

    images: "np.ndarray | LazyImages"
    """Inputs (N, ...): (N, C, H, W) uint8 or float32 images, (N, F) float32 features or
    (N, T) int64 token ids; in memory, on disk or generated on demand."""
    labels: "np.ndarray | LazyTargets"
    """Targets (N, ...): int64 classes (N,), int64 ids per position (N, T), float32 values;
    a plug-in's targets other than classes stay on the workers (only their summary here)."""
    classes: list[str]
    """Class names; label i is classes[i] (empty for float targets or unnamed ids)."""
    num_classes: int | None = None
    """Classes or vocabulary size (None: len(classes); float targets: None)."""
