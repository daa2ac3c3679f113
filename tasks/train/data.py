"""Batches as index slices of a split: in memory when it fits, else streamed from its shards.

No DataLoader: a batch is one gather of raw pixels (uint8 for image data) plus a per-channel
normalisation on the device. A split lives on the GPU when it fits (the gather then runs on
the device, from a device-side permutation); `host` keeps it in host memory behind pinned
staging and one-batch-ahead copies (tasks.train.prefetch); `stream` (and `auto` when it does
not fit) reads each batch from the memory-mapped shards (tasks.train.streaming), so a rank
holds only its batches. The data order of an epoch depends only on (seed, epoch) and the rank,
which is what makes a resumed run take exactly the batches the interrupted one would have taken.
"""

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from trainflow.errors import ConfigError
from trainflow.tasks.preprocess.dataset import load_manifest, load_raw_split, read_manifest
from trainflow.tasks.train.normalise import Normaliser, normaliser_of
from trainflow.tasks.train.prefetch import Batch, Prefetcher
from trainflow.tasks.train.streaming import ShardRows, StreamedSplit

# auto placement keeps at most this share of the free GPU memory for the data; the rest is
# for training.
_DEVICE_SHARE = 0.5
# On CPU ranks, auto keeps a split in memory when all ranks' copies take at most this share of
# the memory available to the job (the cgroup's limit or MemAvailable); else it streams.
_HOST_SHARE = 0.25

Placement = Literal["auto", "device", "host", "stream"]


class SplitData(Protocol):
    """What training and evaluation need of a split, wherever its samples live."""

    def __len__(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where index tensors for `batches` must live."""
        ...

    @property
    def on_host(self) -> bool:
        """True when the samples are not in the compute device's memory."""
        ...

    def batches(self, indices: Sequence[torch.Tensor], device: torch.device) -> Iterator[Batch]:
        """The normalised batches at each index tensor, in order, on `device`."""
        ...


@dataclass(frozen=True)
class Split:
    """One split's samples and labels, on the device or in host memory."""

    x: torch.Tensor
    """(N, ...) samples: raw (with `normaliser`), already normalised, or token ids."""
    y: torch.Tensor
    """(N, ...) targets: int64 classes or ids per position, or float32 values."""
    normaliser: Normaliser | None = None
    """Applied to every batch on its device; None for samples already normalised."""
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

    @property
    def device(self) -> torch.device:
        """Where the samples (and so the index tensors) live."""
        return self.x.device

    def batch(self, index: torch.Tensor, device: torch.device) -> Batch:
        """Samples and labels at `index` (on the split's device), moved to `device`."""
        return self._normalised(self.x[index].to(device)), self.y[index].to(device)

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.normaliser is None else self.normaliser(x)

    def batches(self, indices: Sequence[torch.Tensor], device: torch.device) -> Iterator[Batch]:
        """The batches at each index tensor of `indices`, in order, on `device`.

        A host-resident split bound for a GPU goes through pinned staging buffers with the
        copy of each batch started one batch ahead; anywhere else a batch is one gather where
        the data lives (no copy at all when that is `device`).
        """
        if self.on_host and device.type == "cuda" and indices:
            for x, y in self._prefetcher(device, max(len(i) for i in indices))(indices):
                yield self._normalised(x), y
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


def host_memory_available() -> int:
    """Bytes this process may still use: MemAvailable, capped by its cgroup's limit."""
    available = _meminfo_available()
    for limit_file, usage_file in _cgroup_files():
        try:
            limit = int(limit_file.read_text().split()[0])
            usage = int(usage_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # "max" (no limit), or no such controller
        available = min(available, max(limit - usage, 0))
    return available


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def _cgroup_files() -> list[tuple[Path, Path]]:
    """(limit, usage) files of this process's memory cgroup, v1 and v2."""
    files = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, group = line.split(":", 2)
        if controllers == "memory":
            base = Path("/sys/fs/cgroup/memory") / group.lstrip("/")
            files.append((base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"))
        elif controllers == "":
            base = Path("/sys/fs/cgroup") / group.lstrip("/")
            files.append((base / "memory.max", base / "memory.current"))
    return files


def stream_on_host(placement: Placement, nbytes: int) -> bool:
    """On a CPU rank: True when a split of `nbytes` is streamed rather than loaded.

    auto loads it when every rank's copy together takes at most _HOST_SHARE of the memory
    available (all ranks are assumed to share a node: the cautious reading).
    """
    if placement == "stream":
        return True
    if placement != "auto":
        return False
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    return nbytes * ranks > _HOST_SHARE * host_memory_available()


def place_on_device(placement: Placement, device: torch.device, nbytes: int) -> bool:
    """Whether a split of `nbytes` goes to `device` memory (else host memory or streaming).

    On CPU the host is the device: True unless it streams. ConfigError when placement=device
    asks for more than the GPU has free.
    """
    if device.type != "cuda":
        return not stream_on_host(placement, nbytes)
    if placement in ("host", "stream"):
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
) -> SplitData:
    """Open a split of the dataset at `path` and place it per `placement` (see TrainConfig).

    With `channels_last` the images are stored (or staged) NHWC; index slices keep that
    layout, so no batch is ever converted. A split left on the host is not pinned as a whole:
    only the prefetcher's two staging buffers are. A streamed split reads nothing here.
    """
    ref = read_manifest(path)
    channels_last = channels_last and len(ref.shape) == 3  # images only
    dtype_x = load_manifest(path, check_files=False).get("dtype", {}).get("x", "float32")
    nbytes = ref.counts[split] * (np.dtype(dtype_x).itemsize * math.prod(ref.shape) + 8)
    on_device = place_on_device(placement, device, nbytes)
    normaliser = normaliser_of(ref)
    if placement == "stream" or (placement == "auto" and not on_device):
        return StreamedSplit(ShardRows(path, split, channels_last), normaliser)
    x_np, y_np = load_raw_split(path, split)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if on_device:
        return Split(x.to(device), y.to(device), normaliser)
    return Split(x, y, normaliser)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of range(n) for `epoch`: the same on every rank and every restart."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator)


def steps_per_epoch(n: int, batch_size: int, world_size: int, drop_last: bool = False) -> int:
    """Optimiser steps each rank takes per epoch over `n` samples (see rank_batches)."""
    per_rank = n // world_size
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def rank_batches(
    split: SplitData,
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
    return list(torch.split(mine.to(split.device), batch_size))


def accumulated_batches(
    split: SplitData,
    batch_size: int,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    accumulation: int,
    drop_last: bool = False,
) -> list[torch.Tensor]:
    """This rank's micro-batches for `epoch` when each optimizer step accumulates
    `accumulation` of them: the batches of the data ranks rank*accumulation ... +
    accumulation-1 of a world of world_size*accumulation (rank_batches), interleaved step by
    step (step 0's micro-batches, then step 1's, ...). With accumulation 1: rank_batches."""
    data_world = world_size * accumulation
    first = rank * accumulation
    per_data_rank = [
        rank_batches(split, batch_size, seed, epoch, first + j, data_world, drop_last)
        for j in range(accumulation)
    ]
    return [batch for step in zip(*per_data_rank, strict=True) for batch in step]


def eval_batches(
    split: SplitData, batch_size: int, rank: int, world_size: int
) -> list[torch.Tensor]:
    """This rank's batches for evaluation: every sample exactly once across all ranks."""
    index = torch.arange(rank, len(split), world_size, device=split.device)
    return list(torch.split(index, batch_size))
