"""The preprocess stage on a real local dask cluster: splits, stats, shards, atomic publishing."""

import json
from pathlib import Path

import distributed
import numpy as np
import pytest

from trainflow.errors import DataError
from trainflow.tasks.preprocess import run as run_module
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.dataset import dataset_dir, load_split, read_manifest
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.preprocess.run import run_preprocess, split_indices
from trainflow.tasks.preprocess.sources import fingerprint, load_raw

Cluster = tuple[distributed.Client, str]


def _synthetic(**kw: object) -> PreprocessConfig:
    """3-channel synthetic data over several shards (shard_size 64)."""
    base: dict[str, object] = {
        "source": "synthetic",
        "synthetic_samples": 300,
        "synthetic_shape": (3, 6, 5),
        "shard_size": 64,
    }
    return PreprocessConfig.model_validate({**base, **kw})


def _run(cfg: PreprocessConfig, out: Path, cluster: Cluster, key: str | None = None) -> DatasetRef:
    client, backend = cluster
    return run_preprocess(cfg, out, client, backend, key or fingerprint(cfg))


def _npz_cfg(file: Path, nan: bool = False) -> PreprocessConfig:
    rng = np.random.default_rng(0)
    images = rng.random((40, 6, 6)).astype(np.float32)
    if nan:
        images[17, 2, 2] = np.nan
    file.parent.mkdir(parents=True, exist_ok=True)
    np.savez(file, images=images, labels=np.arange(40) % 4)
    return PreprocessConfig(source="npz", path=file)


def test_split_is_deterministic_disjoint_and_stratified() -> None:
    labels = np.repeat(np.arange(4), [100, 50, 30, 20])
    cfg = PreprocessConfig(source="synthetic", val_fraction=0.2, test_fraction=0.1, seed=7)
    splits = split_indices(labels, cfg)
    again = split_indices(labels, cfg)
    assert all(np.array_equal(splits[s], again[s]) for s in splits)
    assert sorted(np.concatenate(list(splits.values())).tolist()) == list(range(200))
    assert {k: len(v) for k, v in splits.items()} == {"train": 140, "val": 40, "test": 20}
    assert np.bincount(labels[splits["test"]]).tolist() == [10, 5, 3, 2]
    other = split_indices(labels, cfg.model_copy(update={"seed": 8}))
    assert not np.array_equal(np.sort(other["test"]), np.sort(splits["test"]))


def test_split_keeps_at_least_one_test_sample() -> None:
    cfg = PreprocessConfig(source="synthetic", val_fraction=0.0, test_fraction=0.01)
    splits = split_indices(np.arange(10) % 2, cfg)
    assert (len(splits["train"]), len(splits["val"]), len(splits["test"])) == (9, 0, 1)


@pytest.mark.services
def test_stats_shards_and_round_trip(tmp_path: Path, dask_cpu: Cluster) -> None:
    cfg = _synthetic()
    ref = _run(cfg, tmp_path, dask_cpu)
    raw, splits = load_raw(cfg), split_indices(load_raw(cfg).labels, cfg)
    train = raw.images[splits["train"]].astype(np.float64)
    np.testing.assert_allclose(ref.mean, train.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ref.std, train.std(axis=(0, 2, 3)), rtol=1e-5, atol=1e-7)
    assert ref.counts == {"train": 240, "val": 30, "test": 30} and ref.shape == (3, 6, 5)
    assert ref.path == dataset_dir(tmp_path, ref.cache_key) and read_manifest(ref.path) == ref
    manifest = json.loads((ref.path / "manifest.json").read_text())
    assert [s["n"] for s in manifest["splits"]["train"]] == [64, 64, 64, 48]
    assert manifest["splits"]["train"][3]["x"] == "train-00003.x.npy"
    mean, std = np.reshape(ref.mean, (1, 3, 1, 1)), np.reshape(ref.std, (1, 3, 1, 1))
    for split, idx in splits.items():
        x, y = load_split(ref.path, split, verify=True)  # type: ignore[arg-type]
        assert x.dtype == np.float32 and y.dtype == np.int64 and x.flags.c_contiguous
        np.testing.assert_array_equal(y, raw.labels[idx])
        np.testing.assert_allclose(x * std + mean, raw.images[idx], atol=1e-4)


def test_mnist_end_to_end(tmp_path: Path, dask_cpu: Cluster) -> None:
    ref = _run(PreprocessConfig(source="mnist"), tmp_path, dask_cpu)
    assert ref.counts == {"train": 4000, "val": 500, "test": 500}
    x, y = load_split(ref.path, "train")
    assert x.shape == (4000, 1, 28, 28) and abs(float(x.mean())) < 1e-4
    assert abs(float(x.std()) - 1.0) < 1e-3 and np.bincount(y).tolist() == [400] * 10


def test_content_hash_is_stable_and_follows_input(tmp_path: Path, dask_cpu: Cluster) -> None:
    first = _run(_synthetic(), tmp_path / "a", dask_cpu)
    second = _run(_synthetic(), tmp_path / "b", dask_cpu)
    assert first.content_hash == second.content_hash and first.cache_key == second.cache_key
    changed = _run(_synthetic(synthetic_classes=3), tmp_path / "c", dask_cpu)
    assert changed.content_hash != first.content_hash


def test_verify_names_a_corrupt_shard(tmp_path: Path, dask_cpu: Cluster) -> None:
    ref = _run(_synthetic(), tmp_path, dask_cpu)
    shard = ref.path / "val-00000.x.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    load_split(ref.path, "val")  # unverified reads do not notice
    with pytest.raises(DataError, match=r"val-00000\.x\.npy.* is corrupt"):
        load_split(ref.path, "val", verify=True)


def _assert_intact(ref: DatasetRef, out: Path) -> None:
    assert read_manifest(ref.path) == ref
    load_split(ref.path, "train", verify=True)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_bad_input_leaves_previous_dataset_intact(tmp_path: Path, dask_cpu: Cluster) -> None:
    good_cfg = _npz_cfg(tmp_path / "raw" / "d.npz")
    good = _run(good_cfg, tmp_path / "out", dask_cpu)
    bad_cfg = _npz_cfg(tmp_path / "raw" / "d.npz", nan=True)  # same file, now with a NaN
    with pytest.raises(DataError, match=r"d\.npz.*NaN"):
        _run(bad_cfg, tmp_path / "out", dask_cpu, key=good.cache_key)
    _assert_intact(good, tmp_path / "out")


def test_failure_mid_way_publishes_nothing(
    tmp_path: Path, dask_cpu: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    good = _run(_synthetic(), out, dask_cpu)

    def fail(file: Path, content: object) -> None:
        raise DataError("disk full while writing the manifest")

    # Shards are already written by the workers when the manifest write fails.
    monkeypatch.setattr(run_module, "_write_json", fail)
    cfg = _synthetic(seed=5)
    with pytest.raises(DataError, match="disk full"):
        _run(cfg, out, dask_cpu)
    with pytest.raises(DataError, match=r"manifest\.json is missing"):
        read_manifest(dataset_dir(out, fingerprint(cfg)))
    assert not dataset_dir(out, fingerprint(cfg)).exists()
    _assert_intact(good, out)


def test_half_written_folder_is_never_trusted(tmp_path: Path, dask_cpu: Cluster) -> None:
    cfg = _synthetic()
    final = dataset_dir(tmp_path, fingerprint(cfg))
    final.mkdir(parents=True)
    np.save(final / "train-00000.x.npy", np.zeros((3, 3, 6, 5), np.float32))
    with pytest.raises(DataError, match="missing"):
        read_manifest(final)
    (final / "manifest.json").write_text('{"format_version": 1, "splits": ')
    with pytest.raises(DataError, match="unreadable dataset manifest"):
        read_manifest(final)
    ref = _run(cfg, tmp_path, dask_cpu)
    assert ref.path == final and read_manifest(final) == ref
    _assert_intact(ref, tmp_path)


def test_existing_dataset_is_reused_as_is(tmp_path: Path, dask_cpu: Cluster) -> None:
    cfg = _synthetic()
    ref = _run(cfg, tmp_path, dask_cpu)
    before = (ref.path / "manifest.json").stat()
    assert _run(cfg, tmp_path, dask_cpu) == ref
    after = (ref.path / "manifest.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_manifest_missing_a_shard_is_invalid(tmp_path: Path, dask_cpu: Cluster) -> None:
    ref = _run(_synthetic(), tmp_path, dask_cpu)
    (ref.path / "test-00000.y.npy").unlink()
    with pytest.raises(DataError, match=r"lacks shard files \['test-00000\.y\.npy'\]"):
        read_manifest(ref.path)


def test_empty_validation_split_reads_as_empty(tmp_path: Path, dask_cpu: Cluster) -> None:
    ref = _run(_synthetic(val_fraction=0.0), tmp_path, dask_cpu)
    assert ref.counts == {"train": 270, "val": 0, "test": 30}
    x, y = load_split(ref.path, "val", verify=True)
    assert x.shape == (0, 3, 6, 5) and y.shape == (0,)
