"""Sharding an npz source larger than the page cache (not in `make bench`: minutes before the fix).

- Input: generated .npz files of uint8 images (N, 3, 64, 64), `--mib` in all, written with
  NumPy and dropped from the page cache (posix_fadvise) so the stage reads them from disk.
- The real stage (`run_preprocess` on a 1-worker CPU LocalCluster) runs in a child process;
  with root and a writable cgroup v1 memory controller the child runs in a new group limited
  to `--limit-mib` (memory and memory+swap), so the page cache is smaller than the data
  (`--limit-mib 0`: no group, for the same run with all the page cache it wants).
- Prints the data size, the limit, the time to publish the dataset (or, at --timeout, how many
  shards were written by then) and the group's peak memory.

    .venv/bin/python -m bench.npz_shard --mib 1536 --limit-mib 512
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

SAMPLE = (3, 64, 64)
FILE_MIB = 96
V1 = Path("/sys/fs/cgroup/memory")


def write_npz(folder: Path, mib: int) -> int:
    """uint8 npz files of FILE_MIB each (4 classes) totalling `mib`; returns the bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = (FILE_MIB << 20) // int(np.prod(SAMPLE))
    total = 0
    for i in range(max(1, mib // FILE_MIB)):
        labels = rng.integers(0, 4, per_file)
        images = rng.integers(0, 256, (per_file, *SAMPLE), dtype=np.uint8)
        file = folder / f"part{i:03d}.npz"
        np.savez(file, images=images, labels=labels)
        total += images.nbytes
        _drop_cache(file)
    return total


def _drop_cache(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _group(limit: int) -> Path | None:
    """A new memory cgroup limited to `limit` bytes, when this process may make one."""
    if os.geteuid() != 0 or not V1.is_dir():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, name = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = V1 / name.lstrip("/") / f"trainflow-bench-{uuid.uuid4().hex[:12]}"
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(limit))
            if (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
            return group
    return None


def child(raw: Path, out: Path) -> None:
    """The stage itself (runs in the limited group)."""
    from trainflow.cluster.config import DaskConfig
    from trainflow.cluster.dask import dask_client
    from trainflow.tasks.preprocess.config import PreprocessConfig
    from trainflow.tasks.preprocess.run import run_preprocess
    from trainflow.tasks.preprocess.sources import fingerprint

    cfg = PreprocessConfig(source="npz", path=raw, val_fraction=0.1, test_fraction=0.1)
    with dask_client(DaskConfig(backend="cpu", n_workers=1, memory_limit="0")) as (client, be):
        ref = run_preprocess(cfg, out, client, be, fingerprint(cfg))
    print("counts", ref.counts, flush=True)


def main() -> None:
    """Generate, run the stage in a limited group, print the measurements."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=1536)
    parser.add_argument("--limit-mib", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--child", nargs=2, type=Path)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory(prefix="trainflow-npz-bench-") as tmp:
        start = time.monotonic()
        data = write_npz(Path(tmp) / "raw", args.mib)
        print(f"generated {data >> 20} MiB of npz in {time.monotonic() - start:.1f} s")
        group = _group(args.limit_mib << 20) if args.limit_mib else None
        procs = None if group is None else group / "cgroup.procs"
        cmd = [sys.executable, "-m", "bench.npz_shard", "--child", f"{tmp}/raw", f"{tmp}/out"]
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, preexec_fn=None if procs is None else lambda: procs.write_text(str(os.getpid()))
        )
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        took = time.monotonic() - start
        shards = len(list(Path(tmp, "out").rglob("*.x.npy")))
        peak = int((group / "memory.max_usage_in_bytes").read_text()) if group else 0
        limit = f"limit {args.limit_mib} MiB" if group else "no memory limit"
        state = "done" if rc == 0 else f"stopped at {args.timeout:.0f} s" if rc is None else rc
        print(
            f"npz {data >> 20} MiB, {limit}: {state} in {took:.1f} s, {shards} shards written, "
            f"group peak {peak >> 20} MiB"
        )
        if group is not None:
            time.sleep(1)
            for pid in (group / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
            while (group / "cgroup.procs").read_text().split():
                time.sleep(0.1)
            group.rmdir()


if __name__ == "__main__":
    main()
