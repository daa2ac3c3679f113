"""Checks of the raw data that need no pixels: run before any server, cluster or job starts.

What is checked here costs a directory listing, a ``stat`` per file, an image header per
file (PIL reads a few hundred bytes) or an npz member's array header (and its labels): paths,
folder layout, file lists, empty files, files that are not images or not .npz archives,
arrays of Python objects, keys, shapes, dtypes, label ranges and class counts. A problem found
here reports in about a second instead of after the Prefect server and the dask cluster have
started. What needs every pixel decoded (truncated images, NaN/inf) is still found by the
preprocess stage itself, on the workers. Messages match the stage's own for the same problem.

`probe_spec` says what the data will look like (a DataSpec) from the same headers; for a
source plug-in it lists the parts and reads the first one here, so an import error, a raising
read() or unusable arrays also report before any work starts.
"""

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from trainflow.errors import DataError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import normalisation_of
from trainflow.tasks.preprocess.image_files import check_same_size, class_dirs, class_images
from trainflow.tasks.preprocess.npz import npz_files, npz_labels
from trainflow.tasks.preprocess.plugin_source import (
    classes_of,
    list_parts,
    open_source,
    read_arrays,
)
from trainflow.tasks.preprocess.worker_sources import check_headers, list_folder, probe_headers
from trainflow.tasks.spec import DataSpec

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


def preflight_source(cfg: PreprocessConfig) -> None:
    """DataError naming the file and the fix when cfg's raw data is unusable on its face."""
    if cfg.source == "folder":
        _check_folder(_required_path(cfg), cfg.image_size)
    elif cfg.source == "npz":
        _checknpz_files(_required_path(cfg))


def probe_spec(cfg: PreprocessConfig, objective: str = "classification") -> DataSpec:
    """What the dataset of cfg will look like, for a model factory and an objective's checks,
    from headers only (a plug-in: its first part). DataError naming the file or part."""
    if cfg.is_plugin:
        return _plugin_spec(cfg, objective)
    shape, classes = _image_facts(cfg)
    return DataSpec(tuple(shape), "float32", objective, classes, (), "int64")  # type: ignore[arg-type]


def _image_facts(cfg: PreprocessConfig) -> tuple[tuple[int, ...], int]:
    """(C, H, W) and the class count of a built-in source."""
    if cfg.source == "mnist":
        return (1, 28, 28), 10
    if cfg.source == "synthetic":
        return tuple(cfg.synthetic_shape), cfg.synthetic_classes
    path = _required_path(cfg)
    if cfg.source == "folder":
        listing = list_folder(path)
        channels, size = check_headers(listing.files, probe_headers(listing.files), cfg.image_size)
        return (channels, *size), len(listing.classes)
    headers = [read_npz_header(f, want_classes=i == 0) for i, f in enumerate(npz_files(path))]
    names = headers[0].names
    return headers[0].shape, len(names) if names else max(int(h.labels.max()) for h in headers) + 1


def _plugin_spec(cfg: PreprocessConfig, objective: str) -> DataSpec:
    """The spec of a source plug-in's first part (the vocabulary: of that part alone)."""
    plugin = open_source(cfg)
    x, y = read_arrays(plugin, list_parts(plugin)[0])
    shape = tuple(x.shape[1:])
    max_id = int(x.max()) if x.dtype == np.int64 else -1
    _classes, n = classes_of(plugin, y, max_id)
    return DataSpec(
        sample_shape=shape,
        sample_dtype="int64" if normalisation_of(shape, x.dtype) == "none" else "float32",
        objective=objective,  # type: ignore[arg-type]
        num_classes=n,
        target_shape=tuple(y.shape[1:]),
        target_dtype=str(y.dtype),
    )


def _required_path(cfg: PreprocessConfig) -> Path:
    if cfg.path is None:
        raise DataError(f"source={cfg.source!r} needs preprocess.path")
    if not cfg.path.exists():
        raise DataError(f"preprocess.path {str(cfg.path)!r} does not exist")
    return cfg.path


# --- folder ---------------------------------------------------------------------------------


def _check_folder(root: Path, image_size: tuple[int, int] | None) -> None:
    """Class folders with images whose headers say they are images of one size."""
    classes = class_dirs(root)
    first: tuple[Path, tuple[int, ...]] | None = None
    count = 0
    for class_dir in classes:
        files = class_images(class_dir)
        for file in files:
            size = _image_size(file)
            first = first or (file, size)
            if image_size is None:
                check_same_size(file, size, first)
        count += len(files)
    _check_count(count, str(root))  # in the stage's order: counts, then classes
    _check_classes([c.name for c in classes], str(root))


def _image_size(file: Path) -> tuple[int, int]:
    """(height, width) from the image's header; DataError for empty or non-image files."""
    if file.stat().st_size == 0:
        raise DataError(f"image file {str(file)!r} is empty (0 bytes): remove or replace it")
    try:
        with Image.open(file) as img:  # lazy: reads the header, decodes nothing
            width, height = img.size
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError) as exc:
        raise DataError(
            f"cannot read image {str(file)!r} (corrupt or not an image): {exc}"
        ) from exc
    return height, width


# --- npz ------------------------------------------------------------------------------------


def _checknpz_files(path: Path) -> None:
    """Every .npz file: an archive of numeric 'images' and integer 'labels' that agree."""
    files = npz_files(path)
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
    return NpzHeader(images, shape, npz_labels(file, labels, images.shape[0]), names)


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
