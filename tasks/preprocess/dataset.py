"""Readers of a written dataset (manifest.json plus .npy shards), for training and evaluation.

Only a folder whose manifest.json parses and names existing shards is trusted: writers build
datasets in a temporary folder and rename it into place, so a half-written one has no manifest.
"""

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tasks.errors import DataError
from tasks.hashing import sha256_file
from tasks.preprocess.ref import DatasetRef

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
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


def load_split(path: Path, split: Split, verify: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, C, H, W) float32 and labels (N,) int64 of one split, shards concatenated.

    verify=True checks each shard's sha256 against the manifest first (DataError on mismatch).
    """
    manifest = load_manifest(path)
    shards = manifest["splits"][split]
    if verify:
        for shard in shards:
            _verify(path / shard["x"], shard["x_sha256"])
            _verify(path / shard["y"], shard["y_sha256"])
    if not shards:
        shape = (0, *manifest["shape"])
        return np.empty(shape, np.float32), np.empty((0,), np.int64)
    images = np.concatenate([_load_npy(path / s["x"]) for s in shards])
    labels = np.concatenate([_load_npy(path / s["y"]) for s in shards])
    return np.ascontiguousarray(images), np.ascontiguousarray(labels)


def _load_npy(file: Path) -> np.ndarray:
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
