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
from tasks.preprocess.sources import RawSource, load_source
from tasks.preprocess.validate import validate_raw
from tasks.preprocess.writer import (
    ImageRows,
    MappedImages,
    Moments,
    Shard,
    stage,
    train_moments,
    write_shards,
)

__all__ = ["dataset_dir", "read_manifest", "run_preprocess", "split_indices"]

log = logging.getLogger(__name__)

TASK_BYTES = 64 << 20
"""Output bytes per dask task: ~100 ms of work for a CPU core, so dask's ~1 ms per task is noise."""


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
    source = load_source(cfg)
    validate_raw(source, _origin(cfg))
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
        _write_dataset(cfg, source, tmp, client, backend, cache_key)
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
    source: RawSource,
    out: Path,
    client: distributed.Client,
    backend: str,
    cache_key: str,
) -> None:
    """Shards of every split plus manifest.json (written last) into out.

    Two passes over the input: the train statistics, then every split normalised with them and
    written (the first normalised byte needs the last train sample's statistics).
    """
    splits = split_indices(source.labels, cfg)
    raw = source.images
    images = stage(raw, out) if isinstance(raw, np.ndarray) else raw
    # Sent once to every worker: tasks then carry only their row numbers.
    handle = client.scatter(images, broadcast=True, hash=False)
    stats = _train_stats(client, handle, images, splits["train"], backend)
    tasks = {
        name: _shard_groups(name, idx, source.labels, cfg.shard_size, images)
        for name, idx in splits.items()
    }
    futures = {
        name: [
            client.submit(write_shards, handle, group, stats, out, backend, pure=False)
            for group in groups
        ]
        for name, groups in tasks.items()
    }
    done = dict(zip(futures, _gather(client, list(futures.values())), strict=True))
    if isinstance(images, MappedImages):
        images.path.unlink()
    shards = {name: [entry for group in done[name] for entry in group] for name in SPLITS}
    manifest = _manifest(cfg, source, stats, shards, cache_key)
    _write_json(out / MANIFEST, manifest)
    log.info("wrote dataset %s: %s", manifest["content_hash"][:12], manifest["counts"])


def _train_stats(
    client: distributed.Client, handle: Any, images: ImageRows, rows: np.ndarray, backend: str
) -> Moments:
    """Per-channel moments of the train rows, in tasks of about TASK_BYTES each.

    The chunking depends on the data only (not on the cluster), so the float rounding and hence
    the written bytes are the same on any number of workers.
    """
    # Sorted rows read a staged file front to back; the sums do not care about order.
    chunks = np.array_split(np.sort(rows), _task_count(len(rows), images))
    futures = [client.submit(train_moments, handle, c, backend, pure=False) for c in chunks]
    zeros = np.zeros(images.shape[1])
    total = Moments(0.0, zeros, zeros)
    for moments in _gather(client, [futures])[0]:
        total = total.merge(moments)
    return total


def _shard_groups(
    split: str, idx: np.ndarray, labels: np.ndarray, shard_size: int, images: ImageRows
) -> list[list[Shard]]:
    """The shards of a split (shard_size samples each), grouped into tasks of ~TASK_BYTES."""
    shards = [
        Shard(f"{split}-{i:05d}", rows, labels[rows])
        for i, rows in enumerate(idx[s : s + shard_size] for s in range(0, len(idx), shard_size))
    ]
    per_task = max(1, len(shards) // _task_count(len(idx), images)) if shards else 1
    return [shards[i : i + per_task] for i in range(0, len(shards), per_task)]


def _task_count(rows: int, images: ImageRows) -> int:
    """How many tasks of about TASK_BYTES (float32 output) cover this many rows."""
    row_bytes = 4 * int(np.prod(images.shape[1:]))
    return max(1, round(rows * row_bytes / TASK_BYTES))


def _gather(client: distributed.Client, groups: list[list[Any]]) -> list[list[Any]]:
    """Results of groups of futures; on any failure the rest are cancelled, then it raises."""
    flat = [future for group in groups for future in group]
    try:
        results = iter(client.gather(flat))
    except BaseException:
        client.cancel(flat)
        raise
    return [[next(results) for _ in group] for group in groups]


def _manifest(
    cfg: PreprocessConfig,
    source: RawSource,
    stats: Moments,
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
        "shape": list(source.images.shape[1:]),
        "classes": source.classes,
        "mean": [float(v) for v in stats.mean],
        "std": [float(v) for v in stats.std()],
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
