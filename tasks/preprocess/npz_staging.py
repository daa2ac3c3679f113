"""npz sources (and source plug-ins' parts) staged in shard order: each .npz file (each part's
scratch file) is read once, sequentially, by one worker.

1. A worker reads each file's headers and labels (`probe_npz`: no pixel data), so the client
   can check the files, split and plan the shards as for any source.
2. One staging task per file (`stage_npz_rows`) reads the whole file (checked for NaN, shape
   and labels as before) and writes every row straight to its place in the scratch file of
   the shard it belongs to (`.raw-<stem>.npy`, rows already in shard order).
3. Shard-writing tasks then read their rows as one contiguous run (`StagedImages.take`).

A source plug-in's parts are read (inputs and targets staged whole, `.raw-part-*.npy` and
`.raw-part-*.y.npy`) before the split; once split, step 2 moves each part's rows of both into
the shards' scratch files the same way (`stage_part_rows`, targets to `.raw-<stem>.y.npy`), and
deletes the part's files: the shard-writing tasks then read the targets from there too.

Before, each file was staged whole and shard tasks gathered their (shuffled) rows from all
staged files: with more data than page cache every row came from disk on its own (measured:
~2 shards in 4 minutes under a 640 MiB limit with 2 GB of npz data). Now every byte is read
and written sequentially, or as whole rows, once per step.
"""

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import distributed
import numpy as np

from trainflow.errors import DataError
from trainflow.tasks.preprocess.guarded import run_guarded
from trainflow.tasks.preprocess.image_array import FourDimImages
from trainflow.tasks.preprocess.npz import read_npz
from trainflow.tasks.preprocess.plugin_source import PartRows
from trainflow.tasks.preprocess.preflight import read_npz_header
from trainflow.tasks.preprocess.worker_sources import NpzPart
from trainflow.tasks.preprocess.writer import Shard

Gather = Callable[[distributed.Client, list[list[Any]]], list[list[Any]]]


def probe_npz(file: str, index: int) -> NpzPart:
    """Shape, dtype, labels (and, for the first file, class names) of one .npz, from its
    headers and its labels alone (preflight's reader); runs on a worker. DataError names the
    file."""
    header = read_npz_header(Path(file), want_classes=index == 0)
    shape = (header.images.shape[0], *header.shape)
    dtype = "uint8" if header.images.dtype == np.uint8 else "float32"  # as read_npz converts
    return NpzPart(file, shape, dtype, header.labels, header.names)


@dataclass(frozen=True)
class NpzFiles(FourDimImages):
    """The images of probed .npz files, before staging: shape and dtype only."""

    parts: tuple[NpzPart, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, C, H, W)."""
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> np.dtype:
        """uint8 when every file holds uint8, else float32 (as concatenating them would give)."""
        uint8 = all(p.dtype == "uint8" for p in self.parts)
        return np.dtype(np.uint8 if uint8 else np.float32)

    def first_nonfinite(self) -> int | None:
        """None: each file is checked for NaN/inf by the worker that stages it."""
        return None

    def take(self, rows: np.ndarray, xp: ModuleType = np) -> Any:
        """Not readable row by row: `stage_in_shard_order` reads each file once instead."""
        raise RuntimeError("npz files are read once each by stage_in_shard_order, not by rows")


@dataclass(frozen=True)
class StagedImages(FourDimImages):
    """(N, C, H, W) images in scratch .npy files, one per shard, read with pread."""

    paths: tuple[str, ...]
    offsets: tuple[int, ...]
    """Byte offset of the data in each file (after its .npy header)."""
    starts: tuple[int, ...]
    """First global row of each file, plus the total count at the end."""
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    targets: "StagedImages | None" = None
    """A plug-in's targets staged beside the inputs (same rows), which the shard-writing tasks
    write; None where the shards' targets come from the client (npz labels)."""

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, *sample_shape): (N, C, H, W) images, or a plug-in's samples of any shape."""
        return (self.starts[-1], *self.sample_shape)

    @property
    def ndim(self) -> int:
        """1 + the sample's axes."""
        return 1 + len(self.sample_shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample."""
        return self.dtype.itemsize * int(np.prod(self.sample_shape))

    def take(self, rows: np.ndarray, xp: ModuleType = np) -> Any:
        """The rows as a new array of module xp, one pread per run of consecutive rows."""
        out = np.empty((len(rows), *self.sample_shape), self.dtype)
        flat = out.reshape(len(rows), -1).view(np.uint8)
        starts = np.asarray(self.starts)
        owner = np.searchsorted(starts, rows, side="right") - 1
        cuts = np.flatnonzero((np.diff(rows) != 1) | (np.diff(owner) != 0)) + 1
        for begin, end in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)], strict=True):
            f = int(owner[begin])
            offset = self.offsets[f] + int(rows[begin] - starts[f]) * self.row_bytes
            _pread_into(self.paths[f], offset, flat[begin:end])
        return xp.asarray(out)


def _pread_into(path: str, offset: int, out: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(out.reshape(-1).data)
        while len(view):
            got = os.preadv(fd, [view], offset)
            if got <= 0:
                raise OSError(f"short read of staged file {path!r} at byte {offset}")
            view, offset = view[got:], offset + got
    finally:
        os.close(fd)


def create_staged(
    out: Path,
    shards: list[Shard],
    sample_shape: tuple[int, ...],
    dtype: np.dtype,
    suffix: str = ".npy",
) -> StagedImages:
    """One empty (sparse) scratch file `.raw-<stem><suffix>` per shard, sized for its rows,
    in `out`."""
    paths, offsets = [], []
    row_bytes = dtype.itemsize * int(np.prod(sample_shape))
    for shard in shards:
        path = out / f".raw-{shard.stem}{suffix}"
        header: dict[str, Any] = {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": (len(shard.rows), *sample_shape),
        }
        with path.open("wb") as handle:
            np.lib.format.write_array_header_2_0(handle, header)
            offsets.append(handle.tell())
            handle.truncate(handle.tell() + len(shard.rows) * row_bytes)
        paths.append(str(path))
    starts = np.concatenate([[0], np.cumsum([len(s.rows) for s in shards])])
    return StagedImages(
        tuple(paths), tuple(offsets), tuple(int(s) for s in starts), sample_shape, dtype
    )


def stage_npz_rows(file: str, count: int, dest: np.ndarray, staged: StagedImages) -> None:
    """Read one .npz (checked) and write row i to global staged row dest[i]; on a worker."""
    images, _labels, _names = read_npz(Path(file), want_classes=False)
    if len(images) != count:
        raise DataError(
            f"npz file {file!r} changed while it was preprocessed ({count} images, now "
            f"{len(images)}): run again"
        )
    rows = np.ascontiguousarray(images.astype(staged.dtype, copy=False))
    del images
    _scatter_rows(rows, dest, staged)


def stage_part_rows(file: str, target_file: str, dest: np.ndarray, staged: StagedImages) -> None:
    """Move the rows of one part's scratch .npy files (inputs, and targets when staged) to
    staged rows dest (each read once, sequentially, through a read-only mapping), then delete
    them; on a worker."""
    _move_rows(file, dest, staged)
    if staged.targets is not None:
        _move_rows(target_file, dest, staged.targets)


def _move_rows(file: str, dest: np.ndarray, staged: StagedImages) -> None:
    rows = np.load(file, mmap_mode="r")
    _scatter_rows(rows, dest, staged)
    del rows
    os.unlink(file)


def _scatter_rows(rows: np.ndarray, dest: np.ndarray, staged: StagedImages) -> None:
    """Write rows[i] to global staged row dest[i], a run of consecutive rows per write."""
    flat = rows.reshape(len(rows), -1).view(np.uint8)
    starts = np.asarray(staged.starts)
    owner = np.searchsorted(starts, dest, side="right") - 1
    size = staged.row_bytes
    for f in np.unique(owner).tolist():
        mine = np.flatnonzero(owner == f)
        fd = os.open(staged.paths[f], os.O_WRONLY)
        try:
            base = staged.offsets[f] - int(starts[f]) * size
            to = dest[mine]
            # One write per run of rows that are consecutive here and in the staged file
            # (shards keep their rows in source order: one run per file and shard).
            cuts = np.flatnonzero((np.diff(mine) != 1) | (np.diff(to) != 1)) + 1
            for begin, end in zip([0, *cuts.tolist()], [*cuts.tolist(), len(mine)], strict=True):
                run = flat[int(mine[begin]) : int(mine[begin]) + end - begin]
                if os.pwrite(fd, run.data, base + int(to[begin]) * size) != run.nbytes:
                    raise OSError(f"short write to staged file {staged.paths[f]!r}")
            # Start writing these pages back now, without waiting (as writer._start_writeback):
            # under a memory limit, dirty pages left for reclaim to write stall the group.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _check_values(file: str) -> None:
    """Read one .npz with every check (NaN/inf among them); on a worker."""
    read_npz(Path(file), want_classes=False)


def check_float_values(client: distributed.Client, files: NpzFiles, gather: Gather) -> None:
    """DataError naming the first file with NaN/inf, for float files (uint8 holds neither).

    Staging checks every file as it reads it; this is for a run that stages nothing because
    a dataset with the same key exists already: bad input is still reported, as it was when
    files were staged before that check.
    """
    floats = [p.source for p in files.parts if p.dtype != "uint8"]
    gather(client, [[client.submit(run_guarded, _check_values, f, pure=False) for f in floats]])


def stage_in_shard_order(
    client: distributed.Client,
    files: "NpzFiles | PartRows",
    groups: dict[str, list[list[Shard]]],
    out: Path,
    gather: Gather,
) -> tuple[StagedImages, dict[str, list[list[Shard]]]]:
    """Stage every file's rows (.npz files, or a plug-in's staged parts) into per-shard
    scratch files (one task per file, each file read once); returns the staged images and the
    same shard groups over staged rows."""
    shards = [shard for name in groups for group in groups[name] for shard in group]
    staged = create_staged(out, shards, files.shape[1:], files.dtype)
    if isinstance(files, PartRows) and files.target_files:
        shape, dtype = files.target_shape, np.dtype(files.target_dtype)
        targets = create_staged(out, shards, shape, dtype, suffix=".y.npy")
        staged = dataclasses.replace(staged, targets=targets)
    dest = np.empty(len(files), np.int64)
    for k, shard in enumerate(shards):
        dest[shard.rows] = staged.starts[k] + np.arange(len(shard.rows))
    tasks: list[tuple[Any, ...]]
    if isinstance(files, NpzFiles):
        first = np.concatenate([[0], np.cumsum([p.shape[0] for p in files.parts])])
        tasks = [
            (stage_npz_rows, part.source, part.shape[0], dest[first[i] : first[i + 1]])
            for i, part in enumerate(files.parts)
        ]
    else:
        first = np.asarray(files.starts)
        target_files = files.target_files or ("",) * len(files.files)
        tasks = [
            (stage_part_rows, file, target, dest[first[i] : first[i + 1]])
            for i, (file, target) in enumerate(zip(files.files, target_files, strict=True))
        ]
    futures = [client.submit(run_guarded, *task, staged, pure=False) for task in tasks]
    gather(client, [futures])
    position = {id(shard): k for k, shard in enumerate(shards)}
    renumbered = {
        name: [[_staged_shard(s, staged, position[id(s)]) for s in group] for group in grouped]
        for name, grouped in groups.items()
    }
    return staged, renumbered


def _staged_shard(shard: Shard, staged: StagedImages, k: int) -> Shard:
    """The shard over its staged rows (one contiguous run), same stem and labels."""
    rows = np.arange(staged.starts[k], staged.starts[k + 1], dtype=np.int64)
    return Shard(shard.stem, rows, shard.labels)
