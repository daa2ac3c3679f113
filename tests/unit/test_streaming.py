"""Training streamed from memory-mapped uint8 shards: the same batches as in memory, exact
resume, and a rank's peak memory that does not grow with the dataset."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_checkpoint import CrashAfterFirstEpoch
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.dataset import read_manifest
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.checkpointing.checkpoint import latest_checkpoint, load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, load_split_to, rank_batches
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.streaming import StreamedSplit

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def write_uint8_dataset(
    root: Path, n_train: int, shard_size: int = 100, shape: tuple[int, int, int] = (3, 8, 8)
) -> DatasetRef:
    """A learnable uint8 dataset in the preprocessing format (format 2), several shards."""
    rng = np.random.default_rng(0)
    templates = rng.integers(0, 176, (4, *shape), dtype=np.uint8)
    root.mkdir(parents=True)
    splits: dict[str, list[dict[str, object]]] = {}
    for split, n in (("train", n_train), ("val", max(n_train // 8, 8)), ("test", 8)):
        splits[split] = []
        for start in range(0, n, shard_size):
            count = min(shard_size, n - start)
            y = rng.integers(0, 4, count).astype(np.int64)
            x = templates[y] + rng.integers(0, 80, (count, *shape), dtype=np.uint8)
            stem = f"{split}-{start // shard_size:05d}"
            np.save(root / f"{stem}.x.npy", x)
            np.save(root / f"{stem}.y.npy", y)
            entry = {"x": f"{stem}.x.npy", "y": f"{stem}.y.npy", "n": count}
            entry |= {f"{k}_sha256": sha256_file(root / str(entry[k])) for k in ("x", "y")}
            splits[split].append(entry)
    manifest = {
        "format_version": 2,
        "content_hash": f"uint8-{n_train}",
        "cache_key": f"uint8-{n_train}",
        "counts": {s: sum(int(str(e["n"])) for e in entries) for s, entries in splits.items()},
        "shape": list(shape),
        "classes": ["a", "b", "c", "d"],
        "mean": [127.0, 120.5, 131.25][: shape[0]],
        "std": [50.0, 47.5, 52.0][: shape[0]],
        "dtype": {"x": "uint8", "y": "int64"},
        "splits": splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return read_manifest(root)


@pytest.mark.parametrize("channels_last", [False, True])
def test_streamed_batches_equal_in_memory_batches(tmp_path: Path, channels_last: bool) -> None:
    ref = write_uint8_dataset(tmp_path / "d", n_train=530)
    memory = load_split_to(ref.path, "train", CPU, channels_last, placement="host")
    stream = load_split_to(ref.path, "train", CPU, channels_last, placement="stream")
    assert isinstance(memory, Split) and isinstance(stream, StreamedSplit)
    assert memory.x.dtype == torch.uint8  # raw pixels in memory: 4x smaller than float32
    for rank in range(2):
        indices = rank_batches(stream, 64, seed=3, epoch=2, rank=rank, world_size=2)
        pairs = zip(memory.batches(indices, CPU), stream.batches(indices, CPU), strict=True)
        for (mx, my), (sx, sy) in pairs:
            assert sx.dtype == torch.float32
            assert sx.is_contiguous(memory_format=torch.channels_last) == channels_last
            torch.testing.assert_close(sx, mx, atol=0, rtol=0)
            assert torch.equal(sy, my)
    # Normalised with the manifest's statistics: (x - mean) / std.
    x, _ = next(stream.batches([torch.tensor([0])], CPU))
    raw = np.load(ref.path / "train-00000.x.npy")[0].astype(np.float64)
    expected = (raw - np.reshape(ref.mean, (3, 1, 1))) / np.reshape(ref.std, (3, 1, 1))
    np.testing.assert_allclose(x[0].numpy(), expected, rtol=1e-5, atol=1e-5)


def _spec(dataset: DatasetRef, out_dir: Path, placement: str) -> TrainJobSpec:
    train = TrainConfig(
        epochs=2, batch_size=32, precision="fp32", device="cpu", seed=3, data_placement=placement
    )
    return TrainJobSpec(train=train, dataset=dataset, out_dir=out_dir)


def test_a_resumed_streamed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    ref = write_uint8_dataset(tmp_path / "d", n_train=320, shape=(3, 12, 12))
    TrainingJob(_spec(ref, tmp_path / "straight", "stream"))()
    interrupted = _spec(ref, tmp_path / "resumed", "stream")
    with pytest.raises(RuntimeError, match="simulated preemption"):
        CrashAfterFirstEpoch(interrupted)()
    TrainingJob(interrupted)()
    TrainingJob(_spec(ref, tmp_path / "memory", "host"))()
    states = {}
    for name in ("straight", "resumed", "memory"):
        path = latest_checkpoint(tmp_path / name / "checkpoints")
        assert path is not None
        states[name] = load_state(path)
    assert states["resumed"]["step"] == states["straight"]["step"] > 0
    for key, tensor in states["straight"]["model"].items():
        # Resumed = uninterrupted; and streaming trains exactly as the in-memory path does.
        torch.testing.assert_close(states["resumed"]["model"][key], tensor, atol=1e-6, rtol=0)
        torch.testing.assert_close(states["memory"]["model"][key], tensor, atol=1e-6, rtol=0)


_PEAK_RSS = """
import re, sys, torch
from pathlib import Path
from trainflow.tasks.train.data import load_split_to, rank_batches, eval_batches
path, placement = Path(sys.argv[1]), sys.argv[2]
cpu = torch.device("cpu")
train = load_split_to(path, "train", cpu, placement=placement)
for x, y in train.batches(rank_batches(train, 256, 0, 1, 0, 2), cpu):
    assert x.dtype == torch.float32
val = load_split_to(path, "val", cpu, placement=placement)
for x, y in val.batches(eval_batches(val, 256, 0, 2), cpu):
    pass
# VmHWM, not ru_maxrss: the latter keeps the pytest parent's peak across fork and exec.
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024)
"""


def _peak_rss(path: Path, placement: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(path), placement],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.services
def test_a_ranks_peak_memory_does_not_grow_with_the_dataset(tmp_path: Path) -> None:
    shape = (3, 32, 32)  # 3 KiB a sample: 1x = 36 MiB, 4x = 144 MiB of uint8 train shards
    small = write_uint8_dataset(tmp_path / "x1", 12_000, shard_size=4096, shape=shape)
    large = write_uint8_dataset(tmp_path / "x4", 48_000, shard_size=4096, shape=shape)
    # Evaluation batches of 256 samples: with 1024 the 1x run's validation share (750 samples
    # a rank) filled less than one batch, and its smaller batch buffers read as ~18 MiB of
    # "growth" that was only the batch size, not the dataset.
    one, four = _peak_rss(small.path, "stream"), _peak_rss(large.path, "stream")
    assert abs(four - one) <= 0.1 * one, f"peak RSS 1x {one >> 20} MiB, 4x {four >> 20} MiB"
    # The same reads with the split loaded into memory do grow: the test can tell.
    loaded = _peak_rss(large.path, "host")
    assert loaded - four > 80 << 20, f"in memory {loaded >> 20} MiB, streamed {four >> 20}"
