"""Preprocessing and training complete inside a memory cgroup 3x smaller than the dataset.

cgroup v1 (this machine's memory controller; needs root): the payload (flow process, its dask
worker, the training rank) runs in a new group whose limit (memory and memory+swap) is a third
of the dataset's bytes. Before the data moved to the workers and training streamed, the flow
process alone held the whole dataset, and each rank its whole split.
"""

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
V1 = Path("/sys/fs/cgroup/memory")
LIMIT = 640 << 20
FILES, PER_FILE = 20, 14_700
SAMPLE = (48, 12, 12)  # many channels: bytes grow, the models' compute per sample hardly does


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
        group.rmdir()


def _write_npz(folder: Path) -> int:
    """FILES uint8 npz files; returns the total image bytes."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    templates = rng.integers(0, 200, (4, *SAMPLE), dtype=np.uint8)
    noise = rng.integers(0, 56, (PER_FILE, *SAMPLE), dtype=np.uint8)  # drawn once: cheap
    total = 0
    for i in range(FILES):
        labels = rng.integers(0, 4, PER_FILE)
        images = templates[labels] + np.roll(noise, 97 * i, axis=0)
        np.savez(folder / f"part{i:02d}.npz", images=images, labels=labels)
        total += images.nbytes
    return total


def test_pipeline_on_data_3x_the_memory_limit(limited_group: Path, tmp_path: Path) -> None:
    data_bytes = _write_npz(tmp_path / "raw")
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
    assert sum(report["counts"].values()) == FILES * PER_FILE
    assert "oom_kill 0" in oom or "oom_kill" not in oom
    assert peak <= LIMIT
    print(
        f"data {data_bytes >> 20} MiB, limit {LIMIT >> 20} MiB, group peak {peak >> 20} MiB "
        f"(page cache included), flow {report['flow_mib']} MiB, worker {report['worker_mib']}"
    )
