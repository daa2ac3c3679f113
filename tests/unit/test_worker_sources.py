"""Folder and npz sources decoded on the dask workers: same pixels as the in-process loader,
raw uint8 shards, exact statistics, one clear error for a bad file, old datasets rebuilt."""

import json
from pathlib import Path

import distributed
import numpy as np
import pytest
from PIL import Image

from trainflow.errors import DataError
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import (
    FORMAT_VERSION,
    dataset_dir,
    load_raw_split,
    load_split,
    read_manifest,
)
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.preprocess.run import run_preprocess, split_indices
from trainflow.tasks.preprocess.sources import fingerprint, load_raw

Cluster = tuple[distributed.Client, str]


def _folder(root: Path, n: int = 40) -> Path:
    """Three classes of 12x10 images: gray PNGs, RGB JPEGs and RGB PNGs (a mix: all RGB)."""
    rng = np.random.default_rng(0)
    for i in range(n):
        label = i % 3
        shape = (10, 12) if label == 0 else (10, 12, 3)
        img = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        folder = root / ["gray", "jpeg", "png"][label]
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:03d}.{'jpg' if label == 1 else 'png'}")
    return root


def _run(cfg: PreprocessConfig, out: Path, cluster: Cluster) -> DatasetRef:
    client, backend = cluster
    return run_preprocess(cfg, out, client, backend, fingerprint(cfg))


def _assert_same_as_in_process(cfg: PreprocessConfig, ref: DatasetRef) -> None:
    """Shards hold exactly the pixels the in-process loader gives, and exact statistics."""
    raw = load_raw(cfg)
    splits = split_indices(raw.labels, cfg)
    for split, idx in splits.items():
        x, y = load_raw_split(ref.path, split, verify=True)  # type: ignore[arg-type]
        assert x.dtype == raw.images.dtype
        np.testing.assert_array_equal(x, raw.images[idx])
        np.testing.assert_array_equal(y, raw.labels[idx])
    train = raw.images[splits["train"]].astype(np.float64)
    np.testing.assert_allclose(ref.mean, train.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ref.std, train.std(axis=(0, 2, 3)), rtol=1e-10)


def test_folder_is_decoded_on_workers_into_uint8_shards(tmp_path: Path, dask_cpu: Cluster) -> None:
    cfg = PreprocessConfig(source="folder", path=_folder(tmp_path / "raw"), shard_size=64)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert ref.shape == (3, 10, 12) and ref.classes == ["gray", "jpeg", "png"]
    manifest = json.loads((ref.path / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2
    assert manifest["dtype"]["x"] == "uint8"
    _assert_same_as_in_process(cfg, ref)
    # Readers normalise with the manifest's statistics.
    x, _ = load_split(ref.path, "train")
    assert x.dtype == np.float32 and abs(float(x.mean())) < 1e-4


def test_folder_resized_on_workers(tmp_path: Path, dask_cpu: Cluster) -> None:
    cfg = PreprocessConfig(
        source="folder", path=_folder(tmp_path / "raw", n=30), image_size=(7, 5), shard_size=64
    )
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert ref.shape == (3, 7, 5)
    _assert_same_as_in_process(cfg, ref)


def test_npz_files_are_read_on_workers(tmp_path: Path, dask_cpu: Cluster) -> None:
    rng = np.random.default_rng(1)
    folder = tmp_path / "npz"
    folder.mkdir()
    for i, n in enumerate((30, 17, 25)):
        images = rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8)  # channels last
        np.savez(folder / f"part{i}.npz", images=images, labels=np.arange(n) % 4)
    cfg = PreprocessConfig(source="npz", path=folder, shard_size=64)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    assert ref.counts["train"] + ref.counts["val"] + ref.counts["test"] == 72
    _assert_same_as_in_process(cfg, ref)
    assert not list(ref.path.glob(".raw-*")), "scratch files must not be published"


def test_one_corrupt_image_fails_once_naming_it(tmp_path: Path, dask_cpu: Cluster) -> None:
    root = _folder(tmp_path / "raw")
    bad = root / "png" / "005.png"
    bad.write_bytes(bad.read_bytes()[:60])  # a valid header, truncated pixel data
    cfg = PreprocessConfig(source="folder", path=root, shard_size=64)
    with pytest.raises(DataError, match=r"cannot read image .*005\.png") as info:
        _run(cfg, tmp_path / "out", dask_cpu)
    assert "\n" not in str(info.value)
    out = tmp_path / "out"
    assert not dataset_dir(out, fingerprint(cfg)).exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_folder_size_mismatch_found_from_headers(tmp_path: Path, dask_cpu: Cluster) -> None:
    root = _folder(tmp_path / "raw")
    Image.new("L", (20, 16)).save(root / "gray" / "big.png")
    cfg = PreprocessConfig(source="folder", path=root)
    with pytest.raises(DataError, match=r"big\.png.*16x20.*10x12.*image_size=\[10,12\]"):
        _run(cfg, tmp_path / "out", dask_cpu)


def test_dataset_of_the_old_format_is_rebuilt(tmp_path: Path, dask_cpu: Cluster) -> None:
    cfg = PreprocessConfig(source="synthetic", synthetic_samples=100)
    ref = _run(cfg, tmp_path, dask_cpu)
    manifest_file = ref.path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["format_version"] = 1  # as written before raw shards: normalised float32
    manifest_file.write_text(json.dumps(manifest))
    rebuilt = r"not format version 2: run again \(preprocessing rebuilds it\)"
    with pytest.raises(DataError, match=rebuilt):
        read_manifest(ref.path)
    again = _run(cfg, tmp_path, dask_cpu)
    assert again == ref and json.loads(manifest_file.read_text())["format_version"] == 2


def test_npz_rows_are_staged_in_shard_order(tmp_path: Path, dask_cpu: Cluster) -> None:
    """Many small shards fed by every file, a float32 file among uint8 ones (all float32)."""
    rng = np.random.default_rng(2)
    folder = tmp_path / "npz"
    folder.mkdir()
    for i, n in enumerate((300, 170, 241)):
        images = rng.integers(0, 256, (n, 2, 4, 3)).astype(np.float32 if i == 1 else np.uint8)
        np.savez(folder / f"part{i}.npz", images=images, labels=rng.permutation(n) % 3)
    cfg = PreprocessConfig(source="npz", path=folder, shard_size=64)
    ref = _run(cfg, tmp_path / "out", dask_cpu)
    manifest = json.loads((ref.path / "manifest.json").read_text())
    assert manifest["dtype"]["x"] == "float32" and len(manifest["splits"]["train"]) >= 7
    raw = load_raw(cfg)
    splits = split_indices(raw.labels, cfg)
    for split, idx in splits.items():
        x, y = load_raw_split(ref.path, split, verify=True)  # type: ignore[arg-type]
        np.testing.assert_array_equal(x, raw.images[idx])
        np.testing.assert_array_equal(y, raw.labels[idx])
    # float32 blocks: moments merged in float64 from float32 sums (exact only for uint8).
    train = raw.images[splits["train"]].astype(np.float64)
    np.testing.assert_allclose(ref.std, train.std(axis=(0, 2, 3)), rtol=1e-7)
    assert not list(ref.path.glob(".raw-*")), "scratch files must not be published"


def test_npz_nan_found_while_staging_fails_once_naming_the_file(
    tmp_path: Path, dask_cpu: Cluster
) -> None:
    folder = tmp_path / "npz"
    folder.mkdir()
    for i in range(3):
        images = np.ones((20, 1, 4, 4), np.float32)
        if i == 2:
            images[7, 0, 1, 2] = np.nan
        np.savez(folder / f"part{i}.npz", images=images, labels=np.arange(20) % 2)
    cfg = PreprocessConfig(source="npz", path=folder, shard_size=64)
    with pytest.raises(DataError, match=r"part2\.npz.*NaN") as info:
        _run(cfg, tmp_path / "out", dask_cpu)
    assert "\n" not in str(info.value)
    assert not [p for p in (tmp_path / "out").iterdir()], "nothing is published or left"
