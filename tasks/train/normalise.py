"""Normalisation at batch time: shards hold raw inputs, the device turns them into float32.

(x - mean) * (1 / std) per channel (images) or per feature (feature vectors), with the float32
constants of tasks.preprocess.dataset.normaliser: the same values as NumPy readers give, on any
device. Token ids are not normalised (`normaliser_of` gives None).
"""

import torch

from trainflow.tasks.preprocess.dataset import normaliser
from trainflow.tasks.preprocess.ref import DatasetRef


class Normaliser:
    """Per-channel (x - shift) * scale, constants cached per device."""

    def __init__(self, shift: torch.Tensor, scale: torch.Tensor) -> None:
        """Host float32 constants of shape (1, C, 1, 1)."""
        self._shift, self._scale = shift, scale
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of(cls, mean: list[float], std: list[float], ndim: int = 4) -> "Normaliser":
        """The normaliser of a dataset's manifest statistics, for batches of `ndim` axes."""
        shift, scale = normaliser(mean, std, ndim)
        return cls(torch.from_numpy(shift), torch.from_numpy(scale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """A new float32 batch in x's memory format (x: raw uint8 or float32, on any device)."""
        if x.device not in self._on:
            self._on[x.device] = (self._shift.to(x.device), self._scale.to(x.device))
        shift, scale = self._on[x.device]
        out = x.to(torch.float32, copy=True)
        out.sub_(shift).mul_(scale)
        return out


def normaliser_of(ref: DatasetRef) -> Normaliser | None:
    """The normaliser the dataset's manifest asks for; None for normalisation none."""
    if ref.normalisation == "none":
        return None
    return Normaliser.of(ref.mean, ref.std, 1 + len(ref.shape))
