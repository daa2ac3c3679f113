"""A tiny learnable dataset written in the preprocessing format, for training tests."""

import json
from pathlib import Path

import numpy as np

from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.dataset import read_manifest
from trainflow.tasks.preprocess.ref import DatasetRef


def write_dataset(root: Path, n_train: int = 256, n_val: int = 64, seed: int = 0) -> DatasetRef:
    """A tiny learnable dataset in the preprocessing format: 4 stripe patterns in noise."""
    rng = np.random.default_rng(seed)
    i, j = np.mgrid[0:12, 0:12]
    patterns = np.stack([i % 2, j % 2, (i + j) % 2, (i // 2) % 2]).astype(np.float32) * 2 - 1
    root.mkdir(parents=True)
    splits = {}
    for split, n in (("train", n_train), ("val", n_val), ("test", n_val)):
        y = rng.integers(0, 4, n).astype(np.int64)
        x = (patterns[y] + rng.normal(0.0, 1.0, (n, 12, 12)))[:, None].astype(np.float32)
        np.save(root / f"{split}-00000.x.npy", x)
        np.save(root / f"{split}-00000.y.npy", y)
        x_name, y_name = f"{split}-00000.x.npy", f"{split}-00000.y.npy"
        x_sha, y_sha = sha256_file(root / x_name), sha256_file(root / y_name)
        splits[split] = [{"x": x_name, "y": y_name, "n": n, "x_sha256": x_sha, "y_sha256": y_sha}]
    manifest = {
        "format_version": 2,
        "dtype": {"x": "float32", "y": "int64"},
        "content_hash": f"synthetic-{seed}",
        "cache_key": f"synthetic-{seed}",
        "counts": {name: shards[0]["n"] for name, shards in splits.items()},
        "shape": [1, 12, 12],
        "classes": ["rows", "columns", "checks", "wide rows"],
        "mean": [0.0],
        "std": [1.0],
        "splits": splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return read_manifest(root)


def write_rgb_dataset(root: Path, n: int = 8) -> DatasetRef:
    """A 3-channel dataset: with one channel, NCHW and NHWC are the same bytes."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split in ("train", "val", "test"):
        names = {"x": f"{split}-00000.x.npy", "y": f"{split}-00000.y.npy"}
        np.save(root / names["x"], rng.normal(size=(n, 3, 12, 12)).astype(np.float32))
        np.save(root / names["y"], rng.integers(0, 2, n).astype(np.int64))
        hashes = {f"{k}_sha256": sha256_file(root / v) for k, v in names.items()}
        splits[split] = [{**names, **hashes, "n": n}]
    manifest = {
        "format_version": 2,
        "dtype": {"x": "float32", "y": "int64"},
        "content_hash": "rgb",
        "cache_key": "rgb",
        "counts": {split: n for split in splits},
        "shape": [3, 12, 12],
        "classes": ["a", "b"],
        "mean": [0.0] * 3,
        "std": [1.0] * 3,
        "splits": splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return read_manifest(root)


def write_token_dataset(
    root: Path, context: int, vocab: int, n_train: int, n_val: int, seed: int = 0
) -> DatasetRef:
    """Next-token data in the preprocessing format: (n, context) int64 ids of a repeating
    pattern with noise, the same ids shifted by one as targets (train.objective=sequence)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    splits = {}
    for split, n in (("train", n_train), ("val", n_val), ("test", n_val)):
        start = rng.integers(0, vocab, (n, 1))
        ids = (start + np.arange(context + 1)) % vocab  # each next id: the previous + 1
        noise = rng.random(ids.shape) < 0.1
        ids = np.where(noise, rng.integers(0, vocab, ids.shape), ids).astype(np.int64)
        x_name, y_name = f"{split}-00000.x.npy", f"{split}-00000.y.npy"
        np.save(root / x_name, ids[:, :-1])
        np.save(root / y_name, ids[:, 1:])
        x_sha, y_sha = sha256_file(root / x_name), sha256_file(root / y_name)
        splits[split] = [{"x": x_name, "y": y_name, "n": n, "x_sha256": x_sha, "y_sha256": y_sha}]
    manifest = {
        "format_version": 2,
        "dtype": {"x": "int64", "y": "int64"},
        "content_hash": f"tokens-{seed}",
        "cache_key": f"tokens-{seed}",
        "counts": {name: shards[0]["n"] for name, shards in splits.items()},
        "shape": [context],
        "classes": [],
        "mean": [],
        "std": [],
        "target_shape": [context],
        "num_classes": vocab,
        "normalisation": "none",
        "splits": splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return read_manifest(root)
