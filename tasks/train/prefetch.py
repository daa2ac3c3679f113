"""Batches of a host-resident split, copied to the GPU one batch ahead of their step.

For a split too large for GPU memory (or placed on the host on purpose), whether it sits in
host memory or is streamed from memory-mapped shards (tasks.train.streaming). Each batch is
gathered on the host straight into one of two pinned staging buffers and copied with
non_blocking=True on a side CUDA stream; the generator hands batch i to the loop and only
then gathers and copies batch i+1, so both overlap the GPU's work on step i, and the step
waits for its copy on the GPU (an event), never on the host.

Stream rules kept here:
- the compute stream waits for a batch's copy event before using it, and the batch's device
  tensors are recorded on the compute stream (record_stream): they were allocated on the side
  stream, and without that the allocator could hand their memory to the next copy while the
  step still reads it;
- a staging buffer is refilled only after the copy out of it (two batches earlier) finished:
  the host waits on that copy's event, which is long done unless the copies are the bottleneck.

Targets other than CUDA (unit tests on CPU) take the same path with plain staging buffers and
a synchronous copy, so the order and contents of batches are tested without a GPU.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class Rows(Protocol):
    """Host-side samples a batch can be gathered from: tensors, or memory-mapped shards."""

    @property
    def like(self) -> torch.Tensor:
        """A tensor of one sample, shaped (1, C, H, W), in the dtype and memory format of
        the samples (staging buffers are made like it)."""
        ...

    @property
    def labels_like(self) -> torch.Tensor:
        """A tensor of one target, shaped (1, ...), in the targets' dtype."""
        ...

    def gather(self, index: torch.Tensor, x_out: torch.Tensor, y_out: torch.Tensor) -> None:
        """Copy the samples and labels at `index` (host int64) into the front of the buffers."""
        ...


class TensorRows:
    """Rows of host tensors `x` (N, ...) and `y` (N, ...)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Rows of x and y (host tensors)."""
        if x.device.type != "cpu" or y.device.type != "cpu":
            raise ValueError(f"Prefetcher stages host tensors; got x on {x.device}")
        self._x, self._x_rows, self._y = x, rows_view(x), y

    @property
    def like(self) -> torch.Tensor:
        """The first sample's shape, dtype and memory format."""
        return self._x[:1]

    @property
    def labels_like(self) -> torch.Tensor:
        """The first target's shape and dtype."""
        return self._y[:1]

    def gather(self, index: torch.Tensor, x_out: torch.Tensor, y_out: torch.Tensor) -> None:
        """index_select straight into the staging buffers (whole samples, memory order)."""
        torch.index_select(self._x_rows, 0, index, out=rows_view(x_out))
        torch.index_select(self._y, 0, index, out=y_out)


@dataclass
class _Slot:
    """One staging buffer pair and the event of the last copy out of it."""

    x: torch.Tensor
    y: torch.Tensor
    copied: torch.cuda.Event | None = None


@dataclass
class _InFlight:
    """A batch whose copy was started; usable once `copied` has happened."""

    x: torch.Tensor
    y: torch.Tensor
    copied: torch.cuda.Event | None


class Prefetcher:
    """Double-buffered host-to-device batches of `x`/`y` (host tensors) for `device`."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device, capacity: int):
        """Staging for batches of up to `capacity` samples, in the memory format of `x`."""
        self.__init_rows(TensorRows(x, y), device, capacity)

    @classmethod
    def of_rows(cls, rows: Rows, device: torch.device, capacity: int) -> "Prefetcher":
        """A prefetcher gathering from any `Rows` (memory-mapped shards among them)."""
        prefetcher = cls.__new__(cls)
        prefetcher.__init_rows(rows, device, capacity)
        return prefetcher

    def __init_rows(self, rows: Rows, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self._rows = rows
        pin = device.type == "cuda"
        labels = rows.labels_like
        self._slots = [
            _Slot(_staging(rows.like, capacity, pin), _staging(labels, capacity, pin))
            for _ in range(2)
        ]
        self._stream = torch.cuda.Stream(device) if pin else None

    def __call__(self, indices: Sequence[torch.Tensor]) -> Iterator[Batch]:
        """The batches at each (host) index tensor of `indices`, in order, on the device."""
        if not indices:
            return
        pending = self._start(indices[0], self._slots[0])
        for i in range(1, len(indices)):
            yield self._ready(pending)
            # Runs after the loop launched step i-1: the gather and copy overlap it.
            pending = self._start(indices[i], self._slots[i % 2])
        yield self._ready(pending)

    def _start(self, index: torch.Tensor, slot: _Slot) -> _InFlight:
        """Gather `index` into `slot` on the host and start its copy to the device."""
        n = int(index.numel())
        if n > self.capacity:
            raise ValueError(f"batch of {n} exceeds the staging capacity {self.capacity}")
        if slot.copied is not None:
            slot.copied.synchronize()  # the copy two batches back still reads this buffer
        x_stage, y_stage = slot.x[:n], slot.y[:n]
        self._rows.gather(index, x_stage, y_stage)
        if self._stream is None:
            return _InFlight(x_stage.clone(), y_stage.clone(), None)
        with torch.cuda.stream(self._stream):
            x = x_stage.to(self.device, non_blocking=True)
            y = y_stage.to(self.device, non_blocking=True)
            slot.copied = self._stream.record_event()
        return _InFlight(x, y, slot.copied)

    def _ready(self, batch: _InFlight) -> Batch:
        """Make the compute stream wait for the batch's copy; hand the batch over."""
        if batch.copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(batch.copied)
            batch.x.record_stream(compute)
            batch.y.record_stream(compute)
        return batch.x, batch.y


def _staging(like: torch.Tensor, capacity: int, pin: bool) -> torch.Tensor:
    """An empty buffer for `capacity` samples of `like`, in its memory format (pinned: for
    asynchronous copies to a GPU)."""
    fmt = torch.channels_last if _is_nhwc(like) else torch.contiguous_format
    shape = (capacity, *like.shape[1:])
    return torch.empty(shape, dtype=like.dtype, pin_memory=pin, memory_format=fmt)


def _is_nhwc(t: torch.Tensor) -> bool:
    """True for 4-D tensors laid out channels_last that are not also plain contiguous."""
    return (
        t.dim() == 4
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
    )


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as a (N, -1) view in memory order: a gather of rows then copies whole samples.

    Images stored channels_last (NHWC in memory) are viewed through their NHWC permutation,
    so gathering into a channels_last staging buffer keeps the layout. Raises when `t` is
    neither contiguous nor channels_last (no view exists).
    """
    if _is_nhwc(t):
        t = t.permute(0, 2, 3, 1)
    return t.view(t.shape[0], -1) if t.dim() > 1 else t
