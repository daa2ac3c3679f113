"""Any number of shards: a whole pipeline of 20,000 shards under `ulimit -n 256`.

Preprocessing writes, and training, validation and evaluation read, 40,000 shard files while
each process may hold 256 files open (many systems' default soft limit is 1024): the writer
closes shards as it goes, in-memory splits read one shard at a time, streamed ones keep a few
open. This test is about open files, not disks: the workdir is a tmpfs where one can be mounted
(fsync is free there) and a plain temporary folder otherwise, so it runs without root too.
"""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import get_current_settings

from tests.disks import tmpfs_where_possible
from tests.services import service_env

pytestmark = pytest.mark.integration

SAMPLES, SHARD = 40_000, 2  # shard_size 2: 16,000 train, 2,000 val and 2,000 test shards


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    yield from tmpfs_where_possible(tmp_path / "disk", "512m")


def test_a_pipeline_of_20000_shards_runs_under_ulimit_n_256(disk: Path) -> None:
    overrides = [
        f"workdir={disk}",
        f"preprocess.synthetic_samples={SAMPLES}",
        f"preprocess.shard_size={SHARD}",
        "train.epochs=1",
        "train.batch_size=256",
    ]
    command = [sys.executable, "-m", "trainflow.flows.cli", "run", "--preset", "tiny"]
    command += [arg for item in overrides for arg in ("--set", item)]
    env = {k: v for k, v in service_env().items() if k != "TRAINFLOW_DEBUG"}
    api = get_current_settings().api.url  # the session's test server
    if api:
        env["PREFECT_API_URL"] = api
    limited = ["bash", "-c", 'ulimit -n 256 && exec "$@"', "bash", *command]
    out = subprocess.run(limited, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "test accuracy" in out.stdout
    (manifest,) = disk.glob("datasets/*/manifest.json")
    shards = json.loads(manifest.read_text())["splits"]
    assert sum(len(shards[split]) for split in ("train", "val", "test")) == SAMPLES // SHARD
