"""Readers of a written dataset (manifest.json plus .npy shards), for training and evaluation.

Shards hold the raw inputs (uint8 pixels, float32 values, int64 token ids), not normalised:
readers normalise with the manifest's mean and std, `normalise` below, at batch time (per channel
for images, per feature for feature vectors, not at all for token ids: the manifest's
`normalisation` says which). That keeps shards 4x smaller for image data, on disk and on every
read. Targets are int64 classes (N,), int64 ids per position (N, T) or float32 values (N, ...).

Only a folder whose manifest.json parses and names existing shards is trusted: writers build
datasets in a temporary folder and rename it into place, so a half-written one has no manifest.
"""

import errno
import functools
import io
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from trainflow.errors import DataError, TrainflowError
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.open_files import TooManyOpenFilesError, open_files_advice, too_many_open_files
from trainflow.tasks.preprocess.ref import DatasetRef, Normalisation

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: raw uint8/float32 shards, normalised by the reader (1: normalised float32)."""
SPLITS: tuple[str, ...] = ("train", "val", "test")
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}
Split = Literal["train", "val", "test"]


def dataset_dir(out_root: Path, cache_key: str) -> Path:
    """The folder a dataset with this cache key lives in."""
    return out_root / cache_key[:16]


def read_manifest(path: Path) -> DatasetRef:
    """The reference of the dataset in path; DataError when missing, invalid or incomplete."""
    manifest = load_manifest(path)
    try:
        return DatasetRef(
            path=path,
            content_hash=manifest["content_hash"],
            counts=manifest["counts"],
            shape=tuple(manifest["shape"]),
            classes=manifest["classes"],
            mean=manifest["mean"],
            std=manifest["std"],
            cache_key=manifest["cache_key"],
            # Absent in manifests written before any sample shape was allowed: images.
            sample_dtype=manifest["dtype"]["x"],
            target_shape=tuple(manifest.get("target_shape", ())),
            target_dtype=manifest["dtype"].get("y", "int64"),
            num_classes=manifest.get("num_classes"),
            normalisation=manifest.get("normalisation", "per_channel"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"invalid dataset manifest {str(path / MANIFEST)!r}: {exc}") from exc


def load_manifest(path: Path, check_files: bool = True) -> dict[str, Any]:
    """The parsed manifest.json of a dataset folder, checked for version and shard files.

    Parsed once per process while the file is unchanged (a published manifest never changes;
    with 20,000 shards it is ~5 MB and every reader of a split asks for it; the shard files
    are checked on every call unless `check_files` is False: readers that open every shard
    anyway say which is missing then). Callers must not modify what it returns."""
    file = path / MANIFEST
    try:
        stat = file.stat()
    except FileNotFoundError as exc:
        raise DataError(f"no dataset at {str(path)!r}: {MANIFEST} is missing") from exc
    except OSError as exc:
        raise DataError(f"unreadable dataset manifest {str(file)!r}: {exc}") from exc
    manifest = _parsed_manifest(path, stat.st_mtime_ns, stat.st_size, stat.st_ino)
    if not check_files:
        return manifest
    missing = [s[k] for s in _all_shards(manifest, file) for k in ("x", "y")]
    missing = [name for name in missing if not (path / name).is_file()]
    if missing:
        raise DataError(
            f"dataset {str(path)!r} lacks shard files {missing[:5]}: run again (preprocessing "
            "rebuilds it)"
        )
    return manifest


@functools.lru_cache(maxsize=4)
def _parsed_manifest(path: Path, _mtime: int, _size: int, _inode: int) -> dict[str, Any]:
    """manifest.json parsed and its version checked; cached while the file is unchanged."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise DataError(f"no dataset at {str(path)!r}: {MANIFEST} is missing") from exc
    except (OSError, ValueError) as exc:
        raise DataError(f"unreadable dataset manifest {str(file)!r}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"dataset manifest {str(file)!r} is not format version {FORMAT_VERSION}: run again "
            "(preprocessing rebuilds it)"
        )
    return manifest


def _all_shards(manifest: dict[str, Any], file: Path) -> list[dict[str, Any]]:
    try:
        return [shard for split in SPLITS for shard in manifest["splits"][split]]
    except (KeyError, TypeError) as exc:
        raise DataError(f"dataset manifest {str(file)!r} has no valid shard list") from exc


def normalisation_of(shape: tuple[int, ...], dtype: np.dtype) -> Normalisation:
    """What a dataset of samples of `shape` and `dtype` is normalised with: none for integer
    token ids (any integer dtype but uint8, which means pixels), per_feature for feature
    vectors (F,), per_channel (axis 1 of each sample) for anything with more axes."""
    if np.issubdtype(dtype, np.integer) and dtype != np.uint8:
        return "none"
    return "per_feature" if len(shape) == 1 else "per_channel"


def normaliser(mean: list[float], std: list[float], ndim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """(shift, scale) float32 arrays broadcasting over batches of `ndim` axes along axis 1
    ((1, C, 1, 1) for images, (1, F) for features): x_norm = (x - shift) * scale.

    The one formula every reader uses (NumPy here, torch at batch time), so all paths give the
    same float32 values.
    """
    shape = (1, -1, *([1] * (ndim - 2)))
    shift = np.asarray(mean, np.float64).reshape(shape).astype(np.float32)
    scale = (1.0 / np.asarray(std, np.float64)).reshape(shape).astype(np.float32)
    return shift, scale


def normalise(x: np.ndarray, mean: list[float], std: list[float]) -> np.ndarray:
    """Raw samples (N, C, ...) as normalised float32 (a new array); with no statistics
    (normalisation none: token ids) the samples as they are."""
    if not mean:
        return x
    shift, scale = normaliser(mean, std, x.ndim)
    out = x.astype(np.float32)
    out -= shift
    out *= scale
    return out


def split_shards(path: Path, split: Split, verify: bool = False) -> list[dict[str, Any]]:
    """The manifest entries of a split's shards (x, y, n, sha256s), optionally verified."""
    shards: list[dict[str, Any]] = load_manifest(path)["splits"][split]
    if verify:
        _verify_shards(path, shards)
    return shards


def _verify_shards(path: Path, shards: list[dict[str, Any]]) -> None:
    for shard in shards:
        _verify(path / shard["x"], shard["x_sha256"])
        _verify(path / shard["y"], shard["y_sha256"])


def load_raw_split(path: Path, split: Split, verify: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Raw inputs (N, ...) as stored and targets (N, ...), in memory.

    Each shard is read into its place and closed before the next opens: one file open at a
    time, whatever the shard count."""
    manifest = load_manifest(path, check_files=False)  # a missing shard: its read says so
    shards: list[dict[str, Any]] = manifest["splits"][split]
    if verify:
        _verify_shards(path, shards)
    n = sum(int(s["n"]) for s in shards)
    dtypes = manifest.get("dtype", {})
    images = np.empty((n, *manifest["shape"]), dtypes.get("x", "float32"))
    labels = np.empty((n, *manifest.get("target_shape", ())), dtypes.get("y", "int64"))
    start = 0
    for shard in shards:
        end = start + int(shard["n"])
        read_npy_into(path / shard["x"], images[start:end])
        read_npy_into(path / shard["y"], labels[start:end])
        start = end
    return images, labels


def load_split(path: Path, split: Split, verify: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Normalised inputs (N, ...) (token ids as stored) and targets of one split, in memory.

    For small splits (evaluation, benchmarks); training streams (tasks.train.streaming).
    verify=True checks each shard's sha256 against the manifest first (DataError on mismatch).
    """
    x, y = load_raw_split(path, split, verify)
    ref = read_manifest(path)
    return normalise(x, ref.mean, ref.std), y


def open_npy(file: Path) -> np.ndarray:
    """The shard memory-mapped (its header checked); DataError saying why it cannot be read.
    The mapping holds a file descriptor until it is dropped."""
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise shard_error(file, exc) from exc


def npy_header(file: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) of a .npy shard, from its header; the file is closed again."""
    try:
        with file.open("rb") as handle:
            shape, dtype = _read_header(handle)
            return shape, dtype, handle.tell()
    except (OSError, ValueError) as exc:
        raise shard_error(file, exc) from exc


def read_npy_into(file: Path, out: np.ndarray) -> None:
    """Read a .npy shard into `out` (C-contiguous, its shape and dtype), then close it."""
    try:
        with file.open("rb") as handle:
            shape, dtype = _read_header(handle)
            if shape != out.shape or dtype != out.dtype:
                raise ValueError(
                    f"it holds {dtype}{list(shape)}, the manifest says {out.dtype}{list(out.shape)}"
                )
            view = memoryview(out.reshape(-1).view(np.uint8).data)
            got = handle.readinto(view)
            if got != out.nbytes:
                raise ValueError(f"it is truncated: {got} of {out.nbytes} bytes of data")
    except (OSError, ValueError) as exc:
        raise shard_error(file, exc) from exc


def _read_header(handle: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from the .npy header at the start of `handle`, which is left at the data.
    Shards of one split share a few headers: each distinct one is parsed once (numpy's parser
    costs ~0.3 ms, a minute for 200,000 shards)."""
    prefix = handle.read(10)  # magic (6), version (2), v1 header length (2)
    version = (prefix[6], prefix[7]) if len(prefix) == 10 else None
    if version == (2, 0):
        prefix += handle.read(2)  # v2: 4-byte header length
    if prefix[:6] != b"\x93NUMPY" or version not in _HEADER_READERS:
        raise ValueError("it is not a .npy file of format version 1.0 or 2.0")
    length = int.from_bytes(prefix[8:], "little")
    header = handle.read(length)
    if len(header) != length:
        raise ValueError("its header is truncated")
    return _parsed_header(prefix + header)


@functools.lru_cache(maxsize=64)
def _parsed_header(raw: bytes) -> tuple[tuple[int, ...], np.dtype]:
    stream = io.BytesIO(raw)
    version = np.lib.format.read_magic(stream)
    shape, fortran, dtype = _HEADER_READERS[version](stream)
    if fortran or dtype.hasobject:
        raise ValueError("it is not a plain C-ordered array")
    return tuple(shape), dtype


def shard_error(file: Path, exc: BaseException) -> TrainflowError:
    """The error for a shard that cannot be read, with the advice its cause calls for."""
    where = f"cannot read shard {str(file)!r}"
    if too_many_open_files(exc):
        return TooManyOpenFilesError(f"{where}: {open_files_advice()}")
    if isinstance(exc, FileNotFoundError):
        return DataError(f"{where}: it is missing: run again (preprocessing rebuilds the dataset)")
    if isinstance(exc, PermissionError):
        return DataError(f"{where}: {exc}: give this user read access to the dataset folder")
    if isinstance(exc, OSError) and exc.errno == errno.EIO:
        return DataError(f"{where}: {exc}: the disk reports an I/O error; check the disk")
    return DataError(
        f"{where}: {exc}: the dataset is damaged; delete {str(file.parent)!r} and run again "
        "(preprocessing rebuilds it)"
    )


def _verify(file: Path, expected: str) -> None:
    actual = sha256_file(file)
    if actual != expected:
        raise DataError(
            f"shard {str(file)!r} is corrupt: sha256 {actual[:12]}... but the manifest says "
            f"{expected[:12]}...: delete the dataset folder and preprocess again"
        )
