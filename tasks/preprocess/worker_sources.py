"""Folder and npz sources listed on the client and read on the dask workers.

The client only lists files (and, for npz, gets the labels back): every pixel is decoded or
read by a worker, a group of files at a time, so no step holds the whole dataset in memory.

- folder: the client lists class folders and files; workers read the image headers (size and
  colour, a few KB per file) so the client can check that sizes agree and choose 1 or 3
  channels; then each shard-writing task decodes, converts and resizes its own files
  (`FolderImages.take`), on the GPU where the worker has one (tasks.preprocess.gpu_decode)
  and with PIL for what the GPU decoder cannot read.
- npz: workers read each file's headers and labels, then each file is read once by one worker
  and its rows written in shard order to scratch files (tasks.preprocess.npz_staging).

Bad input raises DataError naming the file on the worker; the client runs these functions
through tasks.preprocess.guarded, so it reports the error once instead of a traceback per task.
"""

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

from trainflow.errors import DataError
from trainflow.tasks.preprocess.image_array import FourDimImages
from trainflow.tasks.preprocess.image_files import (
    GRAY_MODES,
    check_same_size,
    class_dirs,
    class_images,
    read_image,
)

PROBE_FILES = 512
"""Image headers read per probe task (~1 ms each: a task of about half a second)."""


# --- folder -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FolderListing:
    """What the client knows of a folder source without reading any pixel."""

    files: list[str]
    """Every image file, class by class, sorted within a class."""
    labels: np.ndarray
    """(N,) int64 class of each file."""
    classes: list[str]
    """Class names (the sorted sub-folder names)."""


def list_folder(root: Path) -> FolderListing:
    """The class folders and image files under root; DataError for a missing or empty class."""
    files: list[str] = []
    labels: list[int] = []
    classes = class_dirs(root)
    for label, class_dir in enumerate(classes):
        images = class_images(class_dir)
        files.extend(str(f) for f in images)
        labels.extend([label] * len(images))
    return FolderListing(files, np.asarray(labels, np.int64), [d.name for d in classes])


def probe_headers(files: list[str]) -> list[tuple[bool, int, int]]:
    """(colour, height, width) of each file from its header alone; runs on a worker."""
    result = []
    for name in files:
        file = Path(name)
        if file.stat().st_size == 0:
            raise DataError(f"image file {name!r} is empty (0 bytes): remove or replace it")
        try:
            with Image.open(file) as img:
                colour = img.mode not in GRAY_MODES
                width, height = img.size
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise DataError(f"cannot read image {name!r} (corrupt or not an image): {exc}") from exc
        result.append((colour, height, width))
    return result


def check_headers(
    files: list[str], headers: list[tuple[bool, int, int]], size: tuple[int, int] | None
) -> tuple[int, tuple[int, int]]:
    """(channels, (H, W)) of the dataset; DataError naming a file whose size differs.

    A mix of grayscale and colour images becomes all colour, as the in-process loader does.
    """
    channels = 3 if any(colour for colour, _h, _w in headers) else 1
    if size is not None:
        return channels, size
    first = (Path(files[0]), headers[0][1:])
    for name, (_colour, h, w) in zip(files, headers, strict=True):
        check_same_size(Path(name), (h, w), first)
    return channels, (headers[0][1], headers[0][2])


@dataclass(frozen=True)
class FolderImages(FourDimImages):
    """(N, C, H, W) uint8 images decoded from files on whichever worker takes them."""

    files: tuple[str, ...]
    channels: int
    size: tuple[int, int]
    resize: bool
    """True when preprocess.image_size is set: every image is resized to `size`."""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(N, C, H, W)."""
        return (len(self.files), self.channels, *self.size)

    @property
    def dtype(self) -> np.dtype:
        """Always uint8."""
        return np.dtype(np.uint8)

    def first_nonfinite(self) -> int | None:
        """uint8 pixels are always finite."""
        return None

    def take(self, rows: np.ndarray, xp: ModuleType = np) -> Any:
        """Decode the files at rows into a new (len(rows), C, H, W) uint8 array of module xp.

        On a GPU worker (xp is CuPy) JPEGs are decoded and resized on the GPU; files that
        decoder cannot read fall back to this CPU path, file by file.
        """
        names = [self.files[int(r)] for r in rows]
        if xp is not np:
            from trainflow.tasks.preprocess.gpu_decode import decode_files_gpu

            return decode_files_gpu(names, self, xp)
        out = np.empty((len(names), self.channels, *self.size), np.uint8)
        for i, name in enumerate(names):
            out[i] = self.decode_cpu(name)
        return out

    def decode_cpu(self, name: str) -> np.ndarray:
        """One file as (C, H, W) uint8 with PIL: the reference path (and the GPU fallback)."""
        array = read_image(Path(name), self.size if self.resize else None)
        if array.shape[:2] != self.size:
            check_same_size(Path(name), array.shape[:2], (Path(self.files[0]), self.size))
        if array.ndim == 2:
            return np.broadcast_to(array, (self.channels, *array.shape))
        return array.transpose(2, 0, 1)


# --- npz --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NpzPart:
    """One npz file as a worker probed it (headers and labels): what it holds."""

    source: str
    shape: tuple[int, ...]
    dtype: str
    labels: np.ndarray
    classes: list[str] | None


def check_parts(parts: list[NpzPart]) -> tuple[np.ndarray, list[str]]:
    """All labels and the class names; DataError for files that do not agree with the first."""
    first = parts[0]
    names = first.classes
    for part in parts[1:]:
        if part.shape[1:] != first.shape[1:]:
            raise DataError(
                f"{part.source!r}: images of shape {part.shape[1:]} (C,H,W) differ from "
                f"{first.shape[1:]} in {first.source!r}: all files must share one shape"
            )
    for part in parts:
        if names is not None and int(part.labels.max()) >= len(names):
            raise DataError(
                f"{part.source!r}: label {int(part.labels.max())} is out of range for the "
                f"{len(names)} classes listed in {first.source!r}"
            )
    labels = np.concatenate([p.labels for p in parts])
    return labels, names or [str(i) for i in range(int(labels.max()) + 1)]
