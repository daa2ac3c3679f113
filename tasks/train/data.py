"""In-memory batches: the splits live as tensors in memory; batches are index slices.

No DataLoader: a preprocessed dataset is already normalised float32, so a batch is one
gather. A split lives on the GPU when it fits (the gather then runs on the device, from a
device-side permutation); otherwise it stays in host memory and `Split.batches` hides the
pinned staging and one-batch-ahead copies (tasks.train.prefetch). The data order of an epoch
depends only on (seed, epoch), which is what makes a resumed run take exactly the batches the
interrupted one would have taken.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from tasks.errors import ConfigError
from tasks.preprocess.dataset import load_split
from tasks.train.prefetch import Batch, Prefetcher

# auto placement keeps at most this share of the free GPU memory for the data; the rest is
# for training.
_DEVICE_SHARE = 0.5

Placement = Literal["auto", "device", "host"]


@dataclass(frozen=True)
class Split:
    """One split's samples and labels, on the device or in host memory."""

    x: torch.Tensor
    """float32 (N, C, H, W), normalised."""
    y: torch.Tensor
    """int64 (N,) class labels."""
    _prefetchers: dict[tuple[torch.device, int], Prefetcher] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Staging buffers of host-to-GPU batches, by (device, batch capacity): made once a run."""

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def on_host(self) -> bool:
        """True when the samples sit in host memory."""
        return self.x.device.type == "cpu"

    def batch(self, index: torch.Tensor, device: torch.device) -> Batch:
        """Samples and labels at `index` (on the split's device), moved to `device`."""
        return self.x[index].to(device), self.y[index].to(device)

    def batches(self, indices: Sequence[torch.Tensor], device: torch.device) -> Iterator[Batch]:
        """The batches at each index tensor of `indices`, in order, on `device`.

        A host-resident split bound for a GPU goes through pinned staging buffers with the
        copy of each batch started one batch ahead; anywhere else a batch is one gather where
        the data lives (no copy at all when that is `device`).
        """
        if self.on_host and device.type == "cuda" and indices:
            yield from self._prefetcher(device, max(len(i) for i in indices))(indices)
            return
        for index in indices:
            yield self.batch(index, device)

    def _prefetcher(self, device: torch.device, capacity: int) -> Prefetcher:
        key = (device, capacity)
        if key not in self._prefetchers:
            self._prefetchers[key] = Prefetcher(self.x, self.y, device, capacity)
        return self._prefetchers[key]


def _fits_on(device: torch.device, nbytes: int, share: float = _DEVICE_SHARE) -> bool:
    """True when `nbytes` take at most `share` of the free memory of `device` (always on CPU)."""
    if device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(device)
    return nbytes <= share * free


def place_on_device(placement: Placement, device: torch.device, nbytes: int) -> bool:
    """Whether a split of `nbytes` goes to `device` memory (else it stays on the host).

    On CPU the host is the device: always True. ConfigError when placement=device asks for
    more than the GPU has free.
    """
    if device.type != "cuda":
        return True
    if placement == "host":
        return False
    if placement == "auto":
        return _fits_on(device, nbytes)
    if not _fits_on(device, nbytes, share=1.0):
        free, _total = torch.cuda.mem_get_info(device)
        raise ConfigError(
            f"train.data_placement=device but a split needs {nbytes / 2**30:.2f} GiB and "
            f"{device} has {free / 2**30:.2f} GiB free: set train.data_placement=auto or host"
        )
    return True


def load_split_to(
    path: Path,
    split: Literal["train", "val", "test"],
    device: torch.device,
    channels_last: bool = False,
    placement: Placement = "auto",
) -> Split:
    """Read a split of the dataset at `path` and place it per `placement` (see TrainConfig).

    With `channels_last` the images are stored NHWC once here; index slices keep that
    layout, so no batch is ever converted. A split left on the host is not pinned as a whole:
    only the prefetcher's two staging buffers are.
    """
    x_np, y_np = load_split(path, split)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if place_on_device(placement, device, x.nbytes + y.nbytes):
        return Split(x.to(device), y.to(device))
    return Split(x, y)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of range(n) for `epoch`: the same on every rank and every restart."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


def steps_per_epoch(n: int, batch_size: int, world_size: int, drop_last: bool = False) -> int:
    """Optimiser steps each rank takes per epoch over `n` samples (see rank_batches)."""
    per_rank = n // world_size
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def rank_batches(
    split: Split,
    batch_size: int,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    drop_last: bool = False,
) -> list[torch.Tensor]:
    """This rank's batches of sample indices for `epoch`, on the split's device.

    Each rank takes a strided slice of the shuffled order, cut to the same length on all
    ranks: every rank then steps the same number of times, so no DDP collective waits for a
    rank that has run out of data. `drop_last` also cuts the last partial batch, so every
    batch has `batch_size` samples (static shapes for CUDA graphs).
    """
    n = len(split)
    per_rank = n // world_size
    if drop_last:
        per_rank -= per_rank % batch_size
    mine = epoch_order(n, seed, epoch)[rank::world_size][:per_rank]
    # Indices move to the data once per epoch: a host-to-device copy per step would sync.
    return list(torch.split(mine.to(split.x.device), batch_size))


def eval_batches(split: Split, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's batches for evaluation: every sample exactly once across all ranks."""
    index = torch.arange(rank, len(split), world_size, device=split.x.device)
    return list(torch.split(index, batch_size))
