"""Preprocessing and training complete inside a memory cgroup 3x smaller than the dataset.

cgroup v1 (this machine's memory controller; needs root): the payload (flow process, its dask
worker, the training rank) runs in a new group whose limit (memory and memory+swap) is a third
of the dataset's decoded bytes (a JPEG folder of 256x256 images, resized to 32x32 by the
stage so that training on CPU stays short: the rank side at full size is
test_streaming.py's 1x/4x peak-RSS test). Before the data moved to the workers, the flow
process alone held the whole decoded dataset.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
V1 = Path("/sys/fs/cgroup/memory")
LIMIT = 640 << 20
FILES = 10_300
SIDE = 256  # 196,608 bytes a decoded RGB image: 10,300 images = 2.03 GB, 3x the limit


def _own_group() -> Path | None:
    """This process's memory cgroup (v1), when we may create groups under it."""
    if os.geteuid() != 0 or not V1.is_dir():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = V1 / group.lstrip("/")
            return path if os.access(path, os.W_OK) else None
    return None


@pytest.fixture
def limited_group() -> Iterator[Path]:
    """A uniquely named memory cgroup limited to LIMIT (no swap beyond it), removed after."""
    parent = _own_group()
    if parent is None:
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    group = parent / f"trainflow-test-{uuid.uuid4().hex[:12]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        memsw = group / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(LIMIT))
        yield group
    finally:
        _empty(group)
        group.rmdir()


def _empty(group: Path) -> None:
    """Wait for the payload's last processes (dask's resource tracker) to leave the group;
    any still there after a minute were started by this test: kill them."""
    deadline = time.monotonic() + 60
    while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in (group / "cgroup.procs").read_text().split():
        os.kill(int(pid), signal.SIGKILL)
    while (group / "cgroup.procs").read_text().split():
        time.sleep(0.1)


def _write_jpegs(folder: Path) -> int:
    """FILES small JPEGs (4 classes) whose decoded pixels total 3x LIMIT; returns that total."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:SIDE, 0:SIDE]
    patterns = [np.stack([xx, yy, xx + yy], -1), np.stack([yy, xx, xx - yy], -1)]
    patterns += [np.stack([xx * 2, yy, yy], -1), np.stack([xx, xx, yy * 2], -1)]
    for label in range(4):
        (folder / f"class{label}").mkdir(parents=True)
    for i in range(FILES):
        label = i % 4
        pixels = (patterns[label] + rng.integers(0, 16)) % 256
        img = Image.fromarray(pixels.astype(np.uint8))
        img.save(folder / f"class{label}" / f"{i:05d}.jpg", quality=80)
    return FILES * 3 * SIDE * SIDE


def test_pipeline_on_data_3x_the_memory_limit(limited_group: Path, tmp_path: Path) -> None:
    data_bytes = _write_jpegs(tmp_path / "raw")
    assert data_bytes >= 3 * LIMIT
    procs = limited_group / "cgroup.procs"
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.memory_payload", str(tmp_path / "raw"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=lambda: procs.write_text(str(os.getpid())),
    )
    oom = (limited_group / "memory.oom_control").read_text()
    peak = int((limited_group / "memory.max_usage_in_bytes").read_text())
    assert done.returncode == 0, f"{oom}\n{done.stderr[-3000:]}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sum(report["counts"].values()) == FILES
    assert "oom_kill 0" in oom or "oom_kill" not in oom
    assert peak <= LIMIT
    print(
        f"data {data_bytes >> 20} MiB, limit {LIMIT >> 20} MiB, group peak {peak >> 20} MiB "
        f"(page cache included), flow {report['flow_mib']} MiB, worker {report['worker_mib']}"
    )
