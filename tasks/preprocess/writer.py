"""The work done on the dask cluster: train statistics, normalisation and shard writing.

One code path for both backends: chunks move to the workers' array module with
map_blocks(xp.asarray), so GPU workers compute with CuPy and CPU workers with NumPy.
"""

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import distributed
import numpy as np

from cluster.dask import array_module, to_numpy

STD_FLOOR = 1e-6


def to_dask(client: distributed.Client, array: np.ndarray, chunk: int, backend: str) -> da.Array:
    """A dask array of array's rows in chunks of `chunk`, scattered to the workers.

    Scattering sends each block straight to a worker instead of through the task graph.
    """
    if len(array) == 0:
        return da.from_array(array, chunks=-1)
    blocks = [array[i : i + chunk] for i in range(0, len(array), chunk)]
    futures = client.scatter(blocks, hash=False)
    parts = [
        da.from_delayed(f, shape=b.shape, dtype=b.dtype)
        for f, b in zip(futures, blocks, strict=True)
    ]
    result = da.concatenate(parts) if len(parts) > 1 else parts[0]
    return result.map_blocks(array_module(backend).asarray) if backend != "numpy" else result


def channel_stats(client: distributed.Client, images: da.Array) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std (floored at STD_FLOOR) of images (N, C, H, W), float64."""
    x = images.astype(np.float64)
    meta = np.empty((0,), np.float64)
    total = x.sum(axis=(0, 2, 3)).map_blocks(to_numpy, meta=meta)
    squares = (x * x).sum(axis=(0, 2, 3)).map_blocks(to_numpy, meta=meta)
    total_np, squares_np = client.compute([total, squares], sync=True)
    count = images.shape[0] * images.shape[2] * images.shape[3]
    mean = np.asarray(total_np) / count
    var = np.maximum(np.asarray(squares_np) / count - mean * mean, 0.0)
    return mean, np.maximum(np.sqrt(var), STD_FLOOR)


def write_split(
    client: distributed.Client,
    split: str,
    images: da.Array,
    labels: np.ndarray,
    stats: tuple[np.ndarray, np.ndarray],
    out: Path,
    backend: str,
) -> list[Any]:
    """Delayed tasks that write normalised shards <split>-NNNNN.{x,y}.npy, one per chunk.

    Each task returns its shard's manifest entry (file names, sample count, sha256s).
    """
    if images.shape[0] == 0:
        return []
    shape = (1, images.shape[1], 1, 1)
    mean, std = (to_dask(client, s.reshape(shape).astype(np.float32), 1, backend) for s in stats)
    x = (images.astype(np.float32) - mean) / std
    y = to_dask(client, labels.astype(np.int64), images.chunks[0][0], "numpy")
    # Unoptimised graphs keep the scattered futures alive until the writes are computed.
    x_blocks = x.to_delayed(optimize_graph=False).ravel()
    y_blocks = y.to_delayed(optimize_graph=False).ravel()
    blocks = zip(x_blocks, y_blocks, strict=True)
    return [
        dask.delayed(write_shard)(xb, yb, out, f"{split}-{i:05d}")
        for i, (xb, yb) in enumerate(blocks)
    ]


def write_shard(images: Any, labels: Any, out: Path, stem: str) -> dict[str, Any]:
    """Write one shard's images (float32) and labels (int64) as .npy; runs on a worker."""
    x_name, y_name = f"{stem}.x.npy", f"{stem}.y.npy"
    x_sha = _save(out / x_name, to_numpy(images).astype(np.float32, copy=False))
    y_sha = _save(out / y_name, to_numpy(labels).astype(np.int64, copy=False))
    return {"x": x_name, "y": y_name, "n": len(labels), "x_sha256": x_sha, "y_sha256": y_sha}


def _save(file: Path, array: np.ndarray) -> str:
    """np.save to file, flushed to disk; returns the sha256 of the bytes written."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    data = buffer.getvalue()
    with file.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return hashlib.sha256(data).hexdigest()
