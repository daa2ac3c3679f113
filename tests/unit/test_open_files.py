"""Open files: a split of many shards is read with a bounded number open, and a shard that
cannot be read says why, with the advice its cause calls for (EMFILE: the limit, `ulimit -n`)."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.unit.datasets import write_dataset
from trainflow.errors import DataError
from trainflow.tasks.open_files import TooManyOpenFilesError
from trainflow.tasks.preprocess.dataset import load_raw_split, read_npy_into, shard_error
from trainflow.tasks.train.streaming import OPEN_SHARDS, ShardRows


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_shard_that_cannot_be_read_gets_the_advice_of_its_cause(tmp_path: Path) -> None:
    shard = tmp_path / "train-00000.x.npy"
    np.save(shard, np.arange(12, dtype=np.float32).reshape(3, 4))
    out = np.empty((3, 4), np.float32)
    read_npy_into(shard, out)
    assert out[2, 3] == 11
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated
    with pytest.raises(DataError, match=r"truncated: 40 of 48 bytes.*delete .* and run again"):
        read_npy_into(shard, out)
    with pytest.raises(DataError, match=r"float32\[3, 4\], the manifest says float32\[2, 4\]"):
        read_npy_into(shard, np.empty((2, 4), np.float32))
    with pytest.raises(DataError, match="it is missing: run again"):
        read_npy_into(tmp_path / "gone.npy", out)
    emfile = shard_error(shard, OSError(errno.EMFILE, "Too many open files"))
    assert isinstance(emfile, TooManyOpenFilesError)
    assert "too many open files: this process may hold" in str(emfile)
    assert "ulimit -n" in str(emfile) and "preprocess" not in str(emfile)


def test_splits_of_many_shards_are_read_with_few_files_open(tmp_path: Path) -> None:
    ref = write_dataset(tmp_path / "ds", n_train=256, n_val=8)
    _split_into_shards(ref.path, "train", rows=1)  # 256 shards: 512 files
    before = _open_fds()
    x, _ = load_raw_split(ref.path, "train")
    assert x.shape == (256, 1, 12, 12) and _open_fds() == before
    rows = ShardRows(ref.path, "train")
    import torch

    x_out, y_out = torch.empty((256, 1, 12, 12)), torch.empty(256, dtype=torch.int64)
    rows.gather(torch.randperm(256), x_out, y_out)
    assert 0 < _open_fds() - before <= OPEN_SHARDS
    del rows
    assert _open_fds() == before


def _split_into_shards(path: Path, split: str, rows: int) -> None:
    """Rewrite a split of a test dataset as shards of `rows` samples (manifest updated)."""
    import json

    from trainflow.tasks.hashing import sha256_file

    manifest = json.loads((path / "manifest.json").read_text())
    (entry,) = manifest["splits"][split]
    x, y = np.load(path / entry["x"]), np.load(path / entry["y"])
    shards = []
    for i in range(0, len(y), rows):
        names = {"x": f"{split}-{i:05d}.x.npy", "y": f"{split}-{i:05d}.y.npy"}
        np.save(path / names["x"], x[i : i + rows])
        np.save(path / names["y"], y[i : i + rows])
        sums = {f"{k}_sha256": sha256_file(path / v) for k, v in names.items()}
        shards.append({**names, "n": len(y[i : i + rows]), **sums})
    manifest["splits"][split] = shards
    (path / "manifest.json").write_text(json.dumps(manifest))


_AT_THE_LIMIT = """
import resource, sys
from pathlib import Path
import numpy as np
from trainflow.tasks.preprocess.dataset import read_npy_into
from trainflow.tasks.preprocess.guarded import run_guarded
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(open(sys.argv[1], "rb"))
except OSError:
    pass
try:
    read_npy_into(Path(sys.argv[1]), np.empty(3, np.int64))
except Exception as exc:
    print(type(exc).__name__, exc)
print(run_guarded(open, sys.argv[1]))
"""


def test_emfile_on_a_shard_and_in_a_worker_names_the_limit(tmp_path: Path) -> None:
    np.save(tmp_path / "s.npy", np.arange(3))
    out = subprocess.run(
        [sys.executable, "-c", _AT_THE_LIMIT, str(tmp_path / "s.npy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("TooManyOpenFilesError cannot read shard")
    assert "this process may hold 64 (`ulimit -n`; hard limit " in lines[0]
    assert "): raise it with `ulimit -n " in lines[0]
    assert lines[1].startswith("Failure(message='preprocess (a dask worker): too many open files")
