"""The preprocess stage: load and check raw data, split, normalise, shard, publish atomically."""

import hashlib
import json
import logging
import os
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import distributed
import numpy as np

from tasks.errors import DataError
from tasks.preprocess.config import PreprocessConfig
from tasks.preprocess.dataset import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    dataset_dir,
    read_manifest,
)
from tasks.preprocess.ref import DatasetRef
from tasks.preprocess.sources import RawData, load_raw
from tasks.preprocess.validate import validate_raw
from tasks.preprocess.writer import channel_stats, to_dask, write_split

__all__ = ["dataset_dir", "read_manifest", "run_preprocess", "split_indices"]

log = logging.getLogger(__name__)


def run_preprocess(
    cfg: PreprocessConfig,
    out_root: Path,
    client: distributed.Client,
    backend: str,
    cache_key: str,
) -> DatasetRef:
    """Write the dataset of cfg under out_root/<cache_key[:16]>/ and return its reference.

    Everything is written to a temporary folder that is renamed into place only when complete;
    an existing valid dataset with the same key is returned as it is.
    """
    raw = load_raw(cfg)
    validate_raw(raw, _origin(cfg))
    out_root = out_root.resolve()  # workers and later stages may not share our cwd
    final = dataset_dir(out_root, cache_key)
    if (final / MANIFEST).is_file():
        try:
            return read_manifest(final)
        except DataError as exc:
            log.warning("rewriting invalid dataset %s: %s", final, exc)
    tmp = out_root / f".tmp-{cache_key[:16]}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        _write_dataset(cfg, raw, tmp, client, backend, cache_key)
        return _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split_indices(labels: np.ndarray, cfg: PreprocessConfig) -> dict[str, np.ndarray]:
    """Deterministic, disjoint train/val/test indices, stratified by class (test >= 1)."""
    rng = np.random.default_rng(cfg.seed)
    n = len(labels)
    n_test = max(1, round(n * cfg.test_fraction))
    n_val = round(n * cfg.val_fraction)
    # Each sample's rank within its shuffled class, spread over [0, 1): cutting the sorted
    # ranks takes every class in proportion, and gives exact split sizes.
    rank = np.empty(n)
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        rank[members] = (np.arange(len(members)) + rng.random()) / len(members)
    order = np.lexsort((rng.random(n), rank))
    parts = np.split(order, [n_test, n_test + n_val])
    names = ("test", "val", "train")
    return {name: rng.permutation(part) for name, part in zip(names, parts, strict=True)}


def _origin(cfg: PreprocessConfig) -> str:
    return f"source {cfg.source!r}" + (f" at {str(cfg.path)!r}" if cfg.path else "")


def _write_dataset(
    cfg: PreprocessConfig,
    raw: RawData,
    out: Path,
    client: distributed.Client,
    backend: str,
    cache_key: str,
) -> None:
    """Shards of every split plus manifest.json (written last) into out."""
    splits = split_indices(raw.labels, cfg)
    images = {
        name: to_dask(client, raw.images[idx], cfg.shard_size, backend)
        for name, idx in splits.items()
    }
    stats = channel_stats(client, images["train"])
    tasks = {
        name: write_split(client, name, images[name], raw.labels[idx], stats, out, backend)
        for name, idx in splits.items()
    }
    # One compute for all splits so every shard of every split is written in parallel.
    results = client.compute([t for name in SPLITS for t in tasks[name]], sync=True)
    shards: dict[str, list[dict[str, Any]]] = {}
    for name in SPLITS:
        shards[name], results = results[: len(tasks[name])], results[len(tasks[name]) :]
    manifest = _manifest(cfg, raw, stats, shards, cache_key)
    _write_json(out / MANIFEST, manifest)
    log.info("wrote dataset %s: %s", manifest["content_hash"][:12], manifest["counts"])


def _manifest(
    cfg: PreprocessConfig,
    raw: RawData,
    stats: tuple[np.ndarray, np.ndarray],
    shards: dict[str, list[dict[str, Any]]],
    cache_key: str,
) -> dict[str, Any]:
    """The manifest: everything a reader needs, and the hashes that identify the bytes."""
    digest = hashlib.sha256()
    for name in SPLITS:
        for shard in shards[name]:
            digest.update(f"{name}:{shard['x_sha256']}:{shard['y_sha256']}\n".encode())
    return {
        "format_version": FORMAT_VERSION,
        "content_hash": digest.hexdigest(),
        "cache_key": cache_key,
        "counts": {name: sum(s["n"] for s in shards[name]) for name in SPLITS},
        "shape": list(raw.images.shape[1:]),
        "classes": raw.classes,
        "mean": [float(v) for v in stats[0]],
        "std": [float(v) for v in stats[1]],
        "dtype": {"x": "float32", "y": "int64"},
        "splits": shards,
        "config": cfg.model_dump(mode="json"),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _write_json(file: Path, content: dict[str, Any]) -> None:
    """Write then rename, so the file is either absent or complete."""
    partial = file.with_suffix(".partial")
    with partial.open("w") as handle:
        json.dump(content, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, file)


def _publish(tmp: Path, final: Path) -> DatasetRef:
    """Rename the finished tmp folder to final; a valid dataset already there wins."""
    if final.exists():
        try:
            return read_manifest(final)
        except DataError:
            # Never trusted without a valid manifest: move aside (atomic), then delete.
            stale = final.with_name(f".stale-{final.name}-{uuid.uuid4().hex}")
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:
        log.info("another run published %s first; keeping it", final)
    return read_manifest(final)
