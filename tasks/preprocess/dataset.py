"""Readers of a written dataset (manifest.json plus .npy shards), for training and evaluation.

Shards hold the raw inputs (uint8 pixels, float32 values, int64 token ids), not normalised:
readers normalise with the manifest's mean and std, `normalise` below, at batch time (per channel
for images, per feature for feature vectors, not at all for token ids: the manifest's
`normalisation` says which). That keeps shards 4x smaller for image data, on disk and on every
read. Targets are int64 classes (N,), int64 ids per position (N, T) or float32 values (N, ...).

Only a folder whose manifest.json parses and names existing shards is trusted: writers build
datasets in a temporary folder and rename it into place, so a half-written one has no manifest.
"""

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from trainflow.tasks.errors import DataError
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.ref import DatasetRef, Normalisation

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: raw uint8/float32 shards, normalised by the reader (1: normalised float32)."""
SPLITS: tuple[str, ...] = ("train", "val", "test")
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


def load_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest.json of a dataset folder, checked for version and shard files."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise DataError(f"no dataset at {str(path)!r}: {MANIFEST} is missing") from exc
    except (OSError, ValueError) as exc:
        raise DataError(f"unreadable dataset manifest {str(file)!r}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"dataset manifest {str(file)!r} is not format version {FORMAT_VERSION}: "
            "preprocess again"
        )
    missing = [s[k] for s in _all_shards(manifest, file) for k in ("x", "y")]
    missing = [name for name in missing if not (path / name).is_file()]
    if missing:
        raise DataError(f"dataset {str(path)!r} lacks shard files {missing[:5]}: preprocess again")
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
        for shard in shards:
            _verify(path / shard["x"], shard["x_sha256"])
            _verify(path / shard["y"], shard["y_sha256"])
    return shards


def load_raw_split(path: Path, split: Split, verify: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Raw inputs (N, ...) as stored and targets (N, ...), in memory."""
    shards = split_shards(path, split, verify)
    if not shards:
        manifest = load_manifest(path)
        shape = (0, *manifest["shape"])
        y_shape = (0, *manifest.get("target_shape", ()))
        return np.empty(shape, manifest["dtype"]["x"]), np.empty(y_shape, manifest["dtype"]["y"])
    images = np.concatenate([open_npy(path / s["x"]) for s in shards])
    labels = np.concatenate([open_npy(path / s["y"]) for s in shards])
    return np.ascontiguousarray(images), np.ascontiguousarray(labels)


def load_split(path: Path, split: Split, verify: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Normalised inputs (N, ...) (token ids as stored) and targets of one split, in memory.

    For small splits (evaluation, benchmarks); training streams (tasks.train.streaming).
    verify=True checks each shard's sha256 against the manifest first (DataError on mismatch).
    """
    x, y = load_raw_split(path, split, verify)
    ref = read_manifest(path)
    return normalise(x, ref.mean, ref.std), y


def open_npy(file: Path) -> np.ndarray:
    try:
        return np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read shard {str(file)!r}: {exc}: preprocess again") from exc


def _verify(file: Path, expected: str) -> None:
    actual = sha256_file(file)
    if actual != expected:
        raise DataError(
            f"shard {str(file)!r} is corrupt: sha256 {actual[:12]}... but the manifest says "
            f"{expected[:12]}...: delete the dataset folder and preprocess again"
        )
