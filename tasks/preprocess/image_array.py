"""What every lazy (N, C, H, W) image source derives from its shape: ndim and len()."""

from abc import ABC, abstractmethod


class FourDimImages(ABC):
    """Base of the lazy image sources (raw.LazyImages): `ndim` and `len()` follow from
    the `shape` property a subclass defines, so numpy-style callers treat them like arrays."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]:
        """(N, C, H, W): defined by each subclass."""

    @property
    def ndim(self) -> int:
        """Always 4: (N, C, H, W)."""
        return 4

    def __len__(self) -> int:
        """N, the number of samples."""
        return self.shape[0]
