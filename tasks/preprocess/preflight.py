"""Checks of the raw data that need no pixels: run before any server, cluster or job starts.

What is checked here costs a directory listing, a ``stat`` per file, an image header per
file (PIL reads a few hundred bytes) or an npz member's array header (and its labels): paths,
folder layout, file lists, empty files, files that are not images or not .npz archives,
arrays of Python objects, keys, shapes, dtypes, label ranges and class counts. A problem found
here reports in about a second instead of after the Prefect server and the dask cluster have
started. What needs every pixel decoded (truncated images, NaN/inf) is still found by the
preprocess stage itself, on the workers. Messages match the stage's own for the same problem.
"""

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from trainflow.tasks.errors import DataError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.npz import _npz_labels
from trainflow.tasks.preprocess.sources import (
    _GRAY_MODES,
    _check_same_size,
    _class_dirs,
    _class_images,
    _npz_files,
)
from trainflow.tasks.spec import DataSpec, image_classification

MIN_SAMPLES = 10  # as tasks/preprocess/validate.py: fewer cannot be split into train/val/test
_ZIP_MAGIC = b"PK\x03\x04"
_EMPTY_ZIP_MAGIC = b"PK\x05\x06"
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


@dataclass(frozen=True)
class ArrayHeader:
    """What an .npy member's header says about its array, read without its data."""

    shape: tuple[int, ...]
    dtype: np.dtype


MNIST_SHAPE = (1, 28, 28)
"""The bundled MNIST's image shape (and it has 10 classes): known without parsing it."""


def preflight_source(cfg: PreprocessConfig) -> None:
    """DataError naming the file and the fix when cfg's raw data is unusable on its face."""
    probe_spec(cfg)


def probe_spec(cfg: PreprocessConfig) -> DataSpec:
    """What the model will be told about cfg's data, from the headers preflight_source checks
    (no pixel read); DataError naming the file and the fix when the data is unusable."""
    if cfg.source == "folder":
        shape, classes = _check_folder(_required_path(cfg), cfg.image_size)
    elif cfg.source == "npz":
        shape, classes = _check_npz_files(_required_path(cfg))
    elif cfg.source == "mnist":
        shape, classes = MNIST_SHAPE, 10
    else:
        shape, classes = cfg.synthetic_shape, cfg.synthetic_classes
    return image_classification(shape, classes)


def _required_path(cfg: PreprocessConfig) -> Path:
    if cfg.path is None:
        raise DataError(f"source={cfg.source!r} needs preprocess.path")
    if not cfg.path.exists():
        raise DataError(f"preprocess.path {str(cfg.path)!r} does not exist")
    return cfg.path


# --- folder ---------------------------------------------------------------------------------


def _check_folder(root: Path, image_size: tuple[int, int] | None) -> tuple[tuple[int, ...], int]:
    """Class folders with images whose headers say they are images of one size; the (C, H, W)
    the stage will make of them and the number of classes."""
    classes = _class_dirs(root)
    first: tuple[Path, tuple[int, ...]] | None = None
    count = 0
    colour = False
    for class_dir in classes:
        files = _class_images(class_dir)
        for file in files:
            size, gray = _image_size(file)
            colour = colour or not gray
            first = first or (file, size)
            if image_size is None:
                _check_same_size(file, size, first)
        count += len(files)
    _check_count(count, str(root))  # in the stage's order: counts, then classes
    _check_classes([c.name for c in classes], str(root))
    height, width = image_size or (first[1] if first else (0, 0))
    return (3 if colour else 1, height, width), len(classes)


def _image_size(file: Path) -> tuple[tuple[int, int], bool]:
    """(height, width) from the image's header and whether the stage reads it as grayscale;
    DataError for empty or non-image files."""
    if file.stat().st_size == 0:
        raise DataError(f"image file {str(file)!r} is empty (0 bytes): remove or replace it")
    try:
        with Image.open(file) as img:  # lazy: reads the header, decodes nothing
            width, height = img.size
            gray = img.mode in _GRAY_MODES
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError) as exc:
        raise DataError(
            f"cannot read image {str(file)!r} (corrupt or not an image): {exc}"
        ) from exc
    return (height, width), gray


# --- npz ------------------------------------------------------------------------------------


def _check_npz_files(path: Path) -> tuple[tuple[int, ...], int]:
    """Every .npz file: an archive of numeric 'images' and integer 'labels' that agree; their
    (C, H, W) and the number of classes."""
    files = _npz_files(path)
    first_shape: tuple[Path, tuple[int, ...]] | None = None
    classes: list[str] | None = None
    counts = np.zeros(0, np.int64)
    for index, file in enumerate(files):
        header = read_npz_header(file, want_classes=index == 0)
        shape, labels, names = header.shape, header.labels, header.names
        first_shape = first_shape or (file, shape)
        if shape != first_shape[1]:
            raise DataError(
                f"{str(file)!r}: images of shape {shape} (C,H,W) differ from "
                f"{first_shape[1]} in {str(files[0])!r}: all files must share one shape"
            )
        classes = names if index == 0 else classes
        if classes is not None and len(labels) and int(labels.max()) >= len(classes):
            raise DataError(
                f"{str(file)!r}: label {int(labels.max())} is out of range for the "
                f"{len(classes)} classes listed in {str(files[0])!r}"
            )
        file_counts = np.bincount(labels.astype(np.int64))
        counts = np.pad(counts, (0, max(0, len(file_counts) - len(counts))))
        counts[: len(file_counts)] += file_counts
    _check_count(int(counts.sum()), str(path))
    names = classes or [str(i) for i in range(len(counts))]
    _check_classes(names, str(path))
    counts = np.pad(counts, (0, len(names) - len(counts)))
    empty = [names[i] for i in np.flatnonzero(counts == 0)]
    if empty:
        raise DataError(f"{path}: classes without any sample: {empty[:10]}")
    return first_shape[1] if first_shape else (), len(names)


@dataclass(frozen=True)
class NpzHeader:
    """What one .npz file holds, read from its headers and its labels alone (no pixels)."""

    images: ArrayHeader
    """The 'images' member's header: its shape as stored (N first) and its dtype."""
    shape: tuple[int, ...]
    """(C, H, W) of each image."""
    labels: np.ndarray
    """(N,) int64 labels, checked against the images' count."""
    names: list[str] | None
    """The 'classes' member's names, when asked for and present."""


def read_npz_header(file: Path, want_classes: bool) -> NpzHeader:
    """The headers and labels of one .npz; DataError names the file and what is wrong."""
    _check_zip_magic(file)
    try:
        with zipfile.ZipFile(file) as archive:
            members = {n.removesuffix(".npy"): n for n in archive.namelist()}
            missing = [k for k in ("images", "labels") if k not in members]
            if missing:
                raise DataError(
                    f"npz file {str(file)!r} lacks {missing}: it has keys {sorted(members)}; "
                    "expected 'images' and 'labels' (optional 'classes')"
                )
            images = _member_header(archive, members["images"], file)
            labels = _member_array(archive, members["labels"], file)
            names = None
            if want_classes and "classes" in members:
                names = [str(c) for c in _member_array(archive, members["classes"], file).ravel()]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"cannot read npz file {str(file)!r} (corrupt?): {exc}") from exc
    shape = _images_shape(file, images)
    return NpzHeader(images, shape, _npz_labels(file, labels, images.shape[0]), names)


def _check_zip_magic(file: Path) -> None:
    """An .npz is a zip archive; anything else gets a message without pickle advice."""
    if file.stat().st_size == 0:
        raise DataError(f"npz file {str(file)!r} is empty (0 bytes): remove or replace it")
    with file.open("rb") as handle:
        magic = handle.read(4)
    if magic not in (_ZIP_MAGIC, _EMPTY_ZIP_MAGIC):
        raise DataError(
            f"cannot read npz file {str(file)!r}: it is not an .npz archive (no zip header; "
            "a single .npy, a pickle or a text file?): write it with "
            "numpy.savez(path, images=..., labels=...)"
        )


def _member_header(archive: zipfile.ZipFile, member: str, file: Path) -> ArrayHeader:
    """The shape and dtype an .npy member declares, reading only its header."""
    with archive.open(member) as handle:
        version = np.lib.format.read_magic(handle)
        read = _HEADER_READERS.get(version)
        if read is None:
            raise DataError(f"{str(file)!r}: {member!r} is an .npy of format {version}: re-save it")
        shape, _fortran, dtype = read(handle)
    if dtype.hasobject:
        raise DataError(
            f"{str(file)!r}: {member.removesuffix('.npy')!r} holds Python objects "
            f"(dtype {dtype}), which trainflow never unpickles (pickles can run code): "
            "save numeric arrays"
        )
    return ArrayHeader(tuple(shape), dtype)


def _member_array(archive: zipfile.ZipFile, member: str, file: Path) -> np.ndarray:
    """A small member (labels, class names) read whole, never unpickled."""
    _member_header(archive, member, file)
    with archive.open(member) as handle:
        return np.lib.format.read_array(handle, allow_pickle=False)


def _images_shape(file: Path, header: ArrayHeader) -> tuple[int, ...]:
    """(C,H,W) as the stage will see it; DataError for shapes and dtypes it refuses."""
    shape, dtype = header.shape, header.dtype
    if len(shape) == 3:
        chw = (1, *shape[1:])
    elif len(shape) == 4 and shape[-1] in (1, 3) and shape[1] not in (1, 3):
        chw = (shape[3], shape[1], shape[2])
    elif len(shape) == 4:
        chw = shape[1:]
    else:
        raise DataError(
            f"{str(file)!r}: 'images' has shape {shape}; expected (N,H,W), (N,C,H,W) or (N,H,W,C)"
        )
    if 0 in shape:
        raise DataError(f"{str(file)!r}: 'images' is empty (shape {shape})")
    if dtype == np.bool_ or not np.issubdtype(dtype, np.number):
        raise DataError(f"{str(file)!r}: 'images' has non-numeric dtype {dtype}")
    return tuple(chw)


# --- both -----------------------------------------------------------------------------------


def _check_classes(names: list[str], origin: str) -> None:
    if len(names) < 2 or len(set(names)) != len(names):
        raise DataError(f"{origin}: need at least 2 distinct class names, got {names}")


def _check_count(count: int, origin: str) -> None:
    if count < MIN_SAMPLES:
        raise DataError(
            f"{origin}: only {count} samples; at least {MIN_SAMPLES} are needed "
            "to split into train/val/test"
        )
