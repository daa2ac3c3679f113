"""The work done on the dask workers: raw shards streamed to disk, with train statistics.

Each task covers tens of MB so that dask's per-task cost (about a millisecond) is noise, and
works through its samples in blocks: a block is taken (read or decoded) from the source, its
moments added (train shards), written and hashed while it is still in the CPU cache, so each
output byte crosses memory about once. Shards keep the source's dtype (uint8 pixels stay uint8);
readers normalise at batch time with the manifest's statistics.
One code path for both backends: blocks are arrays of the worker's array module (NumPy or
CuPy, named by the backend); only the bytes that go to disk come back to the host.
"""

import functools
import hashlib
import io
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, BinaryIO, Protocol

import numpy as np

from trainflow.cluster.dask import array_module, to_numpy

STD_FLOOR = 1e-6
CPU_BLOCK_BYTES = 1 << 20
"""Block size on CPU workers: a block and its temporaries stay in a core's L2 cache."""
GPU_BLOCK_BYTES = 256 << 20
"""Block size on GPU workers: large blocks amortise kernel launches and host transfers."""
WRITEBACK_BYTES = 8 << 20
"""Written bytes after which a shard's new pages are sent to disk in the background."""


class ImageRows(Protocol):
    """(N, C, H, W) images a worker can take any rows of."""

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, C, H, W)."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """uint8 or float32."""
        ...

    def take(self, rows: np.ndarray, xp: ModuleType) -> Any:
        """A new array of module xp holding those rows (the caller may modify it)."""
        ...


@dataclass(frozen=True)
class MappedImages:
    """In-memory images staged to a .npy file that the workers memory-map: no copy per task
    through dask, and the page cache shares one copy between all workers of the host."""

    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype

    def take(self, rows: np.ndarray, xp: ModuleType) -> Any:
        """The rows, copied out of the mapped file (fancy indexing copies)."""
        return xp.asarray(self._mapped[rows])

    @functools.cached_property
    def _mapped(self) -> np.ndarray:
        # Opened once per worker (np.load costs ~0.1 ms a call) and closed with this object,
        # which dask drops when the run releases it: no mapping outlives the scratch file.
        mapped: np.ndarray = np.load(self.path, mmap_mode="r")
        return mapped

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the path, never the mapping (that would copy the whole array)."""
        return {k: v for k, v in self.__dict__.items() if k != "_mapped"}


def stage(images: np.ndarray, folder: Path) -> MappedImages:
    """Write images to folder/.raw-images.npy (a scratch file, never synced) for the workers."""
    path = folder / ".raw-images.npy"
    np.save(path, images, allow_pickle=False)
    return MappedImages(path, images.shape, images.dtype)


@dataclass(frozen=True)
class Shard:
    """One output shard: its file stem, the source rows it holds (in order) and their labels
    (None where the targets stay on the workers: `targets_of` the images gives them)."""

    stem: str
    rows: np.ndarray
    labels: np.ndarray | None


@dataclass(frozen=True)
class Moments:
    """Sample count, per-channel mean and sum of squared deviations (float64)."""

    count: float
    mean: np.ndarray
    m2: np.ndarray

    def merge(self, other: "Moments") -> "Moments":
        """The moments of both sample sets (Chan et al.: no cancellation, any order)."""
        count = self.count + other.count
        if count == 0:
            return self
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        m2 = self.m2 + other.m2 + delta * delta * (self.count * other.count / count)
        return Moments(count, mean, m2)

    def std(self) -> np.ndarray:
        """Population standard deviation, floored at STD_FLOOR."""
        return np.maximum(np.sqrt(self.m2 / max(self.count, 1.0)), STD_FLOOR)


def write_shards(
    images: ImageRows, shards: list[Shard], out: Path, backend: str, moments: bool
) -> tuple[list[dict[str, Any]], Moments | None]:
    """Write each shard's raw pixels as <stem>.x.npy (the source's dtype) and <stem>.y.npy.

    Runs on a worker; returns each shard's manifest entry (file names, count, sha256s) and,
    when `moments`, the per-channel moments of all its samples (merged block by block, in row
    order: the result depends on the data only, not on the cluster).
    """
    xp = array_module(backend)
    entries = []
    zeros = np.zeros(images.shape[1])
    total = [Moments(0.0, zeros, zeros)]  # this task's accumulator, merged in row order

    def add(block: Moments) -> None:
        total[0] = total[0].merge(block)

    with _Flusher() as flusher:
        for shard in shards:
            x_name, y_name = f"{shard.stem}.x.npy", f"{shard.stem}.y.npy"
            x_shape = (len(shard.rows), *images.shape[1:])
            raw = _raw_blocks(images, shard.rows, xp)
            blocks = _with_moments(raw, xp, add) if moments else map(to_numpy, raw)
            x_sha = _write_npy(out / x_name, x_shape, np.dtype(images.dtype), blocks, flusher)
            labels = np.ascontiguousarray(_targets(images, shard))  # int64 or float32
            y_sha = _write_npy(out / y_name, labels.shape, labels.dtype, iter([labels]), flusher)
            entries.append(
                {"x": x_name, "y": y_name, "n": len(labels), "x_sha256": x_sha, "y_sha256": y_sha}
            )
    return entries, (total[0] if moments else None)


def _targets(images: ImageRows, shard: Shard) -> np.ndarray:
    """The shard's targets: staged beside the inputs on the workers (source plug-ins), else
    the labels the client sent with the shard."""
    staged = getattr(images, "targets", None)
    if staged is not None:
        taken: np.ndarray = staged.take(shard.rows, np)
        return taken
    if shard.labels is None:
        raise RuntimeError(f"shard {shard.stem} has neither staged targets nor labels")
    return shard.labels


def _raw_blocks(images: ImageRows, rows: np.ndarray, xp: ModuleType) -> Iterator[Any]:
    """The rows as blocks of module xp in the source's dtype, sized for the backend."""
    budget = CPU_BLOCK_BYTES if xp is np else GPU_BLOCK_BYTES
    step = max(1, budget // (4 * int(np.prod(images.shape[1:]))))
    for start in range(0, len(rows), step):
        yield images.take(rows[start : start + step], xp)


def _with_moments(
    blocks: Iterator[Any], xp: ModuleType, add: Callable[[Moments], None]
) -> Iterator[np.ndarray]:
    """Pass blocks through as host bytes, handing each block's moments to `add`."""
    for block in blocks:
        add(_block_moments(block, xp))
        yield to_numpy(block)


def _block_moments(x: Any, xp: ModuleType) -> Moments:
    """Moments of one block (B, C, H, W): exact integer sums for uint8 pixels; for floats,
    float32 sums per row and float64 across rows."""
    if x.dtype == xp.uint8:
        return _integer_moments(x, xp)
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    count = flat.shape[0] * flat.shape[2]
    mean = to_numpy(flat.sum(axis=2).sum(axis=0, dtype=xp.float64)) / count
    # Squares around the float32-rounded mean, corrected to the exact mean (Steiner).
    centre = mean.astype(np.float32)
    centred = flat - xp.asarray(centre)[None, :, None]
    squares = to_numpy(xp.einsum("ijk,ijk->ij", centred, centred).sum(axis=0, dtype=xp.float64))
    m2 = squares - count * (mean - centre) ** 2
    return Moments(float(count), mean, m2)


def _integer_moments(x: Any, xp: ModuleType) -> Moments:
    """Moments of a uint8 block from exact int64 sums of values and squares."""
    flat = x.reshape(x.shape[0], x.shape[1], -1).astype(xp.int64)
    count = flat.shape[0] * flat.shape[2]
    s1 = [int(v) for v in to_numpy(flat.sum(axis=(0, 2)))]
    s2 = [int(v) for v in to_numpy((flat * flat).sum(axis=(0, 2)))]
    # Python integers: n * sum(x^2) - sum(x)^2 is exact, so is the m2 before its one rounding.
    m2 = np.array([(count * b - a * a) / count for a, b in zip(s1, s2, strict=True)])
    return Moments(float(count), np.array(s1, np.float64) / count, m2)


def _write_npy(
    file: Path, shape: tuple[int, ...], dtype: np.dtype, blocks: Any, flusher: "_Flusher"
) -> str:
    """Stream blocks into a .npy file with a header for shape; returns the file's sha256."""
    header = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(dtype)
    np.lib.format.write_array_header_1_0(
        header, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    digest = hashlib.sha256(header.getvalue())
    handle = file.open("wb")
    try:
        handle.write(header.getvalue())
        written, flushed = len(header.getvalue()), 0
        for block in blocks:
            handle.write(block)
            digest.update(block)
            written += block.nbytes
            if written - flushed >= WRITEBACK_BYTES:
                _start_writeback(handle, flushed, written - flushed)
                flushed = written
    except BaseException:
        handle.close()
        raise
    flusher.submit(handle)
    return digest.hexdigest()


def _start_writeback(handle: BinaryIO, offset: int, length: int) -> None:
    """Have the kernel start writing this range to disk now, without waiting for it.

    Linux starts writeback of dirty pages on POSIX_FADV_DONTNEED (as `dd oflag=nocache`
    relies on): the disk works while we compute, and the final fsync finds little left to do.
    """
    if hasattr(os, "posix_fadvise"):
        handle.flush()
        os.posix_fadvise(handle.fileno(), offset, length, os.POSIX_FADV_DONTNEED)


MAX_UNSYNCED = 16
"""Written files a worker holds open while they wait for their fsync: with tiny shards the
writer outruns fsync, and an unbounded queue ran out of file descriptors (EMFILE under
`ulimit -n 256` with 3,750 shards). The writer waits for the oldest beyond this many."""


class _Flusher:
    """fsync and close written files on a background thread: the disk writes one shard while
    the worker computes the next, at most MAX_UNSYNCED files open. Leaving the block waits for
    all (and re-raises failures)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self._pending: list[Future[None]] = []
        self._open: deque[Future[None]] = deque()

    def submit(self, handle: BinaryIO) -> None:
        future = self._pool.submit(_sync_and_close, handle)
        self._pending.append(future)
        self._open.append(future)
        while self._open and self._open[0].done():
            self._open.popleft()
        if len(self._open) > MAX_UNSYNCED:
            self._open.popleft().result()  # its file is closed now (a failure raises here)

    def __enter__(self) -> "_Flusher":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool.shutdown(wait=True)
        if exc is None:  # else the body's error is the one to report
            for future in self._pending:
                future.result()


def _sync_and_close(handle: BinaryIO) -> None:
    """Flush to disk before the dataset can be published: a renamed folder is a durable one."""
    try:
        handle.flush()
        os.fsync(handle.fileno())
        # Now clean: drop the pages. A GB-sized dataset written once should not push
        # everything else out of the page cache (and growing it cost 2x the kernel CPU here).
        _start_writeback(handle, 0, 0)
    finally:
        handle.close()
