"""In-memory batches: the splits live as tensors on the device; batches are index slices.

No DataLoader: a preprocessed dataset is already normalised float32, so a batch is one
gather on the device. The data order of an epoch depends only on (seed, epoch), which is what
makes a resumed run take exactly the batches the interrupted one would have taken.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tasks.preprocess.dataset import load_split

# Keep at most this share of the free GPU memory for the data; the rest is for training.
_DEVICE_SHARE = 0.5


@dataclass(frozen=True)
class Split:
    """One split's samples and labels, on the device when they fit, else in pinned memory."""

    x: torch.Tensor
    """float32 (N, C, H, W), normalised."""
    y: torch.Tensor
    """int64 (N,) class labels."""

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def batch(self, index: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples and labels at `index` (on the split's device), moved to `device`."""
        x = self.x[index].to(device, non_blocking=True)
        return x, self.y[index].to(device, non_blocking=True)


def _fits_on(device: torch.device, nbytes: int) -> bool:
    if device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(device)
    return nbytes <= _DEVICE_SHARE * free


def load_split_to(
    path: Path,
    split: Literal["train", "val", "test"],
    device: torch.device,
    channels_last: bool = False,
) -> Split:
    """Read a split of the dataset at `path` and place it on `device` when it fits.

    With `channels_last` the images are stored NHWC once here; index slices keep that
    layout, so no batch is ever converted.
    """
    x_np, y_np = load_split(path, split)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if _fits_on(device, x.nbytes + y.nbytes):
        return Split(x.to(device), y.to(device))
    if device.type == "cuda":
        return Split(x.pin_memory(), y.pin_memory())
    return Split(x, y)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of range(n) for `epoch`: the same on every rank and every restart."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


def rank_batches(
    split: Split, batch_size: int, seed: int, epoch: int, rank: int, world_size: int
) -> list[torch.Tensor]:
    """This rank's batches of sample indices for `epoch`, on the split's device.

    Each rank takes a strided slice of the shuffled order, cut to the same length on all
    ranks: every rank then steps the same number of times, so no DDP collective waits for a
    rank that has run out of data.
    """
    n = len(split)
    mine = epoch_order(n, seed, epoch)[rank::world_size][: n // world_size]
    # Indices move to the data once per epoch: a host-to-device copy per step would sync.
    return list(torch.split(mine.to(split.x.device), batch_size))


def eval_batches(split: Split, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's batches for evaluation: every sample exactly once across all ranks."""
    index = torch.arange(rank, len(split), world_size, device=split.x.device)
    return list(torch.split(index, batch_size))
