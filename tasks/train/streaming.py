"""A split streamed from its shard files: each rank reads only its own batches.

For data that does not fit (train.data_placement=stream, or auto when the split is too large
for the device): nothing is concatenated. A batch's rows are read from the shards straight
into the prefetcher's (pinned, on a GPU) staging buffer, copied to the device one batch ahead
and normalised there (raw uint8 travels, 4x fewer bytes than float32).

Rows are read with pread at offsets found from each shard's .npy header, not through a
memory map: measured here, touching a few hundred random rows of a mapped shard brought the
whole file into the rank's RSS (the kernel maps page-cache folios larger than a row, and
fault-around adds 64 KiB per fault), so the mapped pages grew with the dataset. With pread a
rank holds two staging buffers, one batch of read rows, and the per-epoch permutation (8
bytes per sample); the page cache is the kernel's, shared by the ranks of a node and
reclaimable. At most OPEN_SHARDS shard files are open at once, whatever the shard count.
"""

import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from trainflow.tasks.preprocess.dataset import Split as SplitName
from trainflow.tasks.preprocess.dataset import load_manifest, npy_header, shard_error
from trainflow.tasks.train.normalise import Normaliser
from trainflow.tasks.train.prefetch import Batch, Prefetcher

OPEN_SHARDS = 64
"""Shard files a split keeps open at once (least recently read closed first): the rows of a
batch come from at most batch-size shards, so a split of any shard count stays far below any
`ulimit -n`, and a mostly sequential read (evaluation) reopens nothing."""


class _ShardFile:
    """One .npy shard: its layout from its header, read in whole rows at known offsets."""

    def __init__(self, file: Path) -> None:
        shape, dtype, self.offset = npy_header(file)  # checks the header; closed again
        self.file, self.rows = file, int(shape[0]) if shape else 0
        self.row_bytes = dtype.itemsize * int(np.prod(shape[1:]))

    def read(self, fd: int, local: np.ndarray, out: np.ndarray) -> None:
        """Rows `local` into `out` (contiguous, len(local) rows) from this shard opened as
        `fd`; one pread per run of consecutive rows (a shuffled batch: one per row;
        evaluation's ordered batches: one)."""
        view = memoryview(out.reshape(-1).view(np.uint8).data)
        size = self.row_bytes
        cuts = (np.flatnonzero(np.diff(local) != 1) + 1).tolist()
        for begin, end in zip([0, *cuts], [*cuts, len(local)], strict=True):
            row = int(local[begin])
            part = view[begin * size : end * size]
            got = os.preadv(fd, [part], self.offset + row * size)
            if got != len(part):
                raise shard_error(self.file, OSError(f"short read at row {row}: {got} bytes"))


class _OpenFiles:
    """At most `limit` shard files open, the least recently read closed first."""

    def __init__(self, limit: int = OPEN_SHARDS) -> None:
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._limit = limit

    def fd(self, file: Path) -> int:
        """An open descriptor of `file`, opened now if it is not open."""
        if file in self._fds:
            self._fds.move_to_end(file)
            return self._fds[file]
        while len(self._fds) >= self._limit:
            os.close(self._fds.popitem(last=False)[1])
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError as exc:
            raise shard_error(file, exc) from exc
        self._fds[file] = fd
        return fd

    def close(self) -> None:
        """Close every open file."""
        while self._fds:
            os.close(self._fds.popitem()[1])


class ShardRows:
    """The rows of one split's shards, read batch by batch (prefetch.Rows)."""

    def __init__(self, path: Path, split: SplitName, channels_last: bool = False) -> None:
        """Read the headers of every shard of `split` of the dataset at `path`, one file open
        at a time; no row is read yet."""
        manifest = load_manifest(path, check_files=False)  # each header read says what is missing
        shards = manifest["splits"][split]
        self._x = [_ShardFile(path / s["x"]) for s in shards]
        self._y = [_ShardFile(path / s["y"]) for s in shards]
        self._files = _OpenFiles()
        counts = [f.rows for f in self._y]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.sample_shape = tuple(int(v) for v in manifest["shape"])
        self.target_shape = tuple(int(v) for v in manifest.get("target_shape", ()))
        self.dtype = np.dtype(manifest["dtype"]["x"])
        self.target_dtype = np.dtype(manifest["dtype"].get("y", "int64"))
        self._channels_last = channels_last and len(self.sample_shape) == 3

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __del__(self) -> None:
        files = getattr(self, "_files", None)
        if files is not None:
            files.close()

    @property
    def like(self) -> torch.Tensor:
        """One sample's shape, dtype and memory format (NHWC with channels_last)."""
        like = torch.empty((1, *self.sample_shape), dtype=_torch_dtype(self.dtype))
        return like.contiguous(memory_format=torch.channels_last) if self._channels_last else like

    @property
    def labels_like(self) -> torch.Tensor:
        """One target's shape and dtype."""
        return torch.empty((1, *self.target_shape), dtype=_torch_dtype(self.target_dtype))

    def gather(self, index: torch.Tensor, x_out: torch.Tensor, y_out: torch.Tensor) -> None:
        """Copy the rows at `index` (global, host int64) into x_out/y_out, in index order."""
        rows = index.numpy()
        owner = np.searchsorted(self._starts, rows, side="right") - 1
        x_rows = np.empty((len(rows), *self.sample_shape), self.dtype)
        y_rows = np.empty((len(rows), *self.target_shape), self.target_dtype)
        for shard in np.unique(owner):
            mine = np.flatnonzero(owner == shard)
            local = rows[mine] - self._starts[shard]
            x_part = np.empty((len(mine), *self.sample_shape), self.dtype)
            y_part = np.empty((len(mine), *self.target_shape), self.target_dtype)
            x_file, y_file = self._x[shard], self._y[shard]
            x_file.read(self._files.fd(x_file.file), local, x_part)
            y_file.read(self._files.fd(y_file.file), local, y_part)
            x_rows[mine], y_rows[mine] = x_part, y_part
        x_out.copy_(torch.from_numpy(x_rows))  # into the staging layout (NHWC or not)
        y_out.copy_(torch.from_numpy(y_rows))


class StreamedSplit:
    """One split read batch by batch from memory-mapped shards, normalised on the device."""

    def __init__(self, rows: ShardRows, normaliser: Normaliser | None) -> None:
        """Batches of `rows`, normalised with `normaliser` (None: as stored, token ids)."""
        self.rows = rows
        self._normaliser = normaliser
        self._prefetchers: dict[tuple[torch.device, int], Prefetcher] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def device(self) -> torch.device:
        """Index tensors live on the host: the rows are gathered there."""
        return torch.device("cpu")

    @property
    def on_host(self) -> bool:
        """Always True: the samples stay in the shard files."""
        return True

    def batches(self, indices: Sequence[torch.Tensor], device: torch.device) -> Iterator[Batch]:
        """The normalised batches at each index tensor of `indices`, in order, on `device`."""
        if not indices:
            return
        capacity = max(len(i) for i in indices)
        key = (device, capacity)
        if key not in self._prefetchers:
            self._prefetchers[key] = Prefetcher.of_rows(self.rows, device, capacity)
        for x, y in self._prefetchers[key](indices):
            yield (x if self._normaliser is None else self._normaliser(x)), y


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype
