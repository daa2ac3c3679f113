"""Evaluation streams the test split from its shards: the same metrics, to the last digit, as
evaluating the split loaded into memory (the code of the stage before it streamed)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainflow.errors import DataError
from trainflow.tasks.evaluate.predict import confusion_streamed
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.objectives import metrics
from trainflow.tasks.preprocess.dataset import load_split, read_manifest
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model

SHAPE = (3, 12, 12)
TEST_SHARDS = (300, 300, 171)  # batches of 128 straddle the shards' ends


def _write_dataset(root: Path, dtype: str) -> DatasetRef:
    """A dataset (manifest format 2) whose test split spans TEST_SHARDS; train/val are tiny."""
    rng = np.random.default_rng(1)
    templates = rng.integers(0, 176, (4, *SHAPE))
    root.mkdir(parents=True)
    splits: dict[str, list[dict[str, object]]] = {}
    for split, sizes in (("train", (16,)), ("val", (8,)), ("test", TEST_SHARDS)):
        splits[split] = []
        for i, count in enumerate(sizes):
            y = rng.integers(0, 4, count).astype(np.int64)
            x = (templates[y] + rng.integers(0, 80, (count, *SHAPE))).astype(dtype)
            stem = f"{split}-{i:05d}"
            np.save(root / f"{stem}.x.npy", x)
            np.save(root / f"{stem}.y.npy", y)
            entry: dict[str, object] = {"x": f"{stem}.x.npy", "y": f"{stem}.y.npy", "n": count}
            entry |= {f"{k}_sha256": sha256_file(root / f"{stem}.{k}.npy") for k in ("x", "y")}
            splits[split].append(entry)
    manifest = {
        "format_version": 2,
        "content_hash": f"eval-{dtype}",
        "cache_key": f"eval-{dtype}",
        "counts": {s: sum(int(str(e["n"])) for e in v) for s, v in splits.items()},
        "shape": list(SHAPE),
        "classes": ["a", "b", "c", "d"],
        "mean": [127.3, 120.5, 131.25],
        "std": [50.1, 47.5, 52.7],
        "dtype": {"x": dtype, "y": "int64"},
        "splits": splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return read_manifest(root)


def _in_memory(model: torch.nn.Module, ref: DatasetRef, batch: int) -> tuple[np.ndarray, ...]:
    """Today's evaluation before streaming: the whole split loaded, predicted in batches."""
    x, y = load_split(ref.path, "test", verify=True)
    preds = []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            preds.append(model(torch.from_numpy(x[i : i + batch])).argmax(dim=1).numpy())
    return metrics.confusion_matrix(y, np.concatenate(preds), len(ref.classes)), x[:4]


@pytest.mark.services
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_streamed_evaluation_gives_the_in_memory_metrics(tmp_path: Path, dtype: str) -> None:
    ref = _write_dataset(tmp_path / "d", dtype)
    torch.manual_seed(0)
    model = build_model(
        TrainConfig(model="resnet", width=4), image_classification(ref.shape, 4)
    ).eval()
    cm, example = confusion_streamed(model, ref, batch_size=128)
    cm_memory, example_memory = _in_memory(model, ref, 128)
    assert cm.sum() == sum(TEST_SHARDS)
    assert (cm.sum(axis=0) > 0).sum() >= 2, "a model predicting one class proves little"
    np.testing.assert_array_equal(cm, cm_memory)
    flat = metrics.flat_metrics(cm, metrics.per_class_report(cm, ref.classes))
    expected = metrics.flat_metrics(cm_memory, metrics.per_class_report(cm_memory, ref.classes))
    assert flat == expected  # every metric, to the last digit
    assert example.dtype == np.float32 and example.shape == (4, *SHAPE)
    np.testing.assert_array_equal(example, example_memory)


def test_a_corrupt_test_shard_is_refused_before_evaluating(tmp_path: Path) -> None:
    ref = _write_dataset(tmp_path / "d", "uint8")
    shard = ref.path / "test-00001.x.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    model = build_model(TrainConfig(width=4), image_classification(ref.shape, 4)).eval()
    with pytest.raises(DataError, match=r"test-00001\.x\.npy' is corrupt"):
        confusion_streamed(model, ref, batch_size=128)
