"""P2: preprocessing throughput over memory-copy bandwidth, 1 -> 2 worker speed-up, 1x -> 10x.

The real stage (`run_preprocess`: load, validate, split, train statistics, normalised shards
with sha256s, fsync, manifest, atomic rename) on a real dask LocalCluster, side by side with a
memory-copy measurement in the same run:

- Input: the synthetic source, float32 CIFAR-sized samples (3x32x32, 12 KiB), 1 GiB of raw
  images (87,382 samples; 10 GiB for the scaling run). Its images are generated on the workers.
- Throughput: raw input bytes / median wall time of run_preprocess (each run into a fresh folder
  under the system temp dir, on its real disk; the cluster is started beforehand).
- Copy bandwidth: bytes / median time of a copy between two prefaulted 1 GiB arrays (NumPy on
  CPU, CuPy on a GPU backend).
- Context: the same 1 GiB run with its output on a RAM-backed file system (no disk under it);
  the workers' CPU seconds per GiB and their growth from 1x to 10x (less noisy than wall time
  on a shared machine); one core's sha256 rate (the content hash of every output byte); the
  median task length.
"""

import os
import shutil
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import distributed
import numpy as np

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.preprocess.sources import fingerprint

GIB = 1 << 30
SHAPE = (3, 32, 32)
SAMPLE_BYTES = 4 * 3 * 32 * 32
RAM_DISK = Path("/dev/shm")
"""A RAM-backed file system (Linux): 1 GiB runs there show the stage without the disk."""
REPEATS = 5
"""Timed rounds at 1x (after one warm-up round); a round runs each cluster once."""


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Measure P2 and return (title, rows, result)."""
    load_before = os.getloadavg()[0]  # others' load on a shared machine skews every wall time
    with tempfile.TemporaryDirectory(prefix="trainflow-p2-") as scratch, ExitStack() as stack:
        root = Path(scratch)
        main, backend = stack.enter_context(dask_client(DaskConfig(n_workers=2)))
        clusters = {"two_workers": (main, backend)}
        # The worker comparison runs on CPU workers (a CUDA cluster has one worker per GPU).
        if backend != "numpy":
            cpu_two = stack.enter_context(dask_client(DaskConfig(backend="cpu", n_workers=2)))
            clusters["two_cpu_workers"] = cpu_two
        clusters["one_worker"] = stack.enter_context(
            dask_client(DaskConfig(backend="cpu", n_workers=1))
        )
        plan = [(name, client, be, root) for name, (client, be) in clusters.items()]
        if RAM_DISK.is_dir():  # the same run with no disk under it: what the CPUs can do
            plan.append(("two_workers_ram", main, backend, Path(stack.enter_context(_ram_dir()))))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, *_ in plan}
        copies = []
        # Interleaved rounds share the machine's noise; the first round is a warm-up.
        for round_ in range(REPEATS + 1):
            copies.append(_copy_bandwidth(backend))
            for name, client, client_backend, folder in plan:
                record = _run_once(client, client_backend, _config(1), folder)
                if round_:
                    runs[name].append(record)
        ten = _run_once(main, backend, _config(10), root)
    summary = {name: _summary(records) for name, records in runs.items()}
    summary["ten_x"] = _summary([ten])
    title, rows, result = _report(backend, statistics.median(copies[1:]), summary)
    rows.append(("load average before the run", f"{load_before:.1f}", "context (2 cores)"))
    result["load_average_before"] = load_before
    return title, rows, result


def _ram_dir() -> tempfile.TemporaryDirectory[str]:
    """A scratch folder on the RAM disk, removed on exit."""
    return tempfile.TemporaryDirectory(prefix="trainflow-p2-", dir=RAM_DISK)


def _config(factor: int) -> PreprocessConfig:
    """factor GiB (rounded up to whole samples) of float32 synthetic images."""
    samples = -(-factor * GIB // SAMPLE_BYTES)
    return PreprocessConfig(source="synthetic", synthetic_samples=samples, synthetic_shape=SHAPE)


def _run_once(
    client: distributed.Client, backend: str, cfg: PreprocessConfig, root: Path
) -> dict[str, Any]:
    """One run_preprocess into a fresh folder: wall time, workers' CPU time, task lengths."""
    out = root / "out"
    cpu_before = _worker_cpu(client)
    with distributed.get_task_stream(client) as stream:
        start = time.perf_counter()
        run_preprocess(cfg, out, client, backend, fingerprint(cfg))
        elapsed = time.perf_counter() - start
    cpu = _worker_cpu(client) - cpu_before
    shutil.rmtree(out)
    nbytes = cfg.synthetic_samples * SAMPLE_BYTES
    return {"bytes": nbytes, "seconds": elapsed, "cpu": cpu, "tasks": _task_seconds(stream.data)}


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs of one configuration."""
    nbytes = records[0]["bytes"]
    tasks = [t for r in records for t in r["tasks"]]
    return {
        "bytes": nbytes,
        "seconds": statistics.median(r["seconds"] for r in records),
        "runs_s": [round(r["seconds"], 3) for r in records],
        "worker_cpu_s_per_gib": statistics.median(r["cpu"] for r in records) * GIB / nbytes,
        "median_task_ms": 1000 * statistics.median(tasks),
        "tasks_per_run": len(tasks) // len(records),
    }


def _worker_cpu(client: distributed.Client) -> float:
    """CPU seconds used so far by all worker processes together."""
    return float(sum(client.run(time.process_time).values()))


def _task_seconds(stream: list[dict[str, Any]]) -> list[float]:
    """Compute time of each task in a task-stream record."""
    return [
        sum(s["stop"] - s["start"] for s in task["startstops"] if s["action"] == "compute")
        for task in stream
    ]


def _copy_bandwidth(backend: str, nbytes: int = GIB, repeats: int = 3) -> float:
    """Bytes per second copied between two prefaulted arrays of the backend's device."""
    if backend == "cupy":
        import cupy

        xp: Any = cupy
        sync = cupy.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    src = xp.ones(nbytes // 4, dtype=xp.float32)
    dst = xp.zeros_like(src)  # zeros touch every page: no page faults inside the timing
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        xp.copyto(dst, src)
        sync()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:])


def _sha256_rate(nbytes: int = 256 << 20) -> float:
    """Bytes per second one core hashes with sha256."""
    import hashlib

    data = bytes(nbytes)
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return nbytes / (time.perf_counter() - start)


def _report(
    backend: str, copy_bps: float, runs: dict[str, dict[str, Any]]
) -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Rows and the JSON result."""
    two = runs["two_workers"]
    rate = two["bytes"] / two["seconds"]
    ratio = rate / copy_bps
    speedup = runs["one_worker"]["seconds"] / runs.get("two_cpu_workers", two)["seconds"]
    growth = runs["ten_x"]["seconds"] / two["seconds"]
    cpu_growth = 10 * runs["ten_x"]["worker_cpu_s_per_gib"] / two["worker_cpu_s_per_gib"]
    sha = _sha256_rate()
    device = "CuPy" if backend == "cupy" else "NumPy"
    rows = [
        ("preprocess, 1 GiB float32 in, 2 workers", f"{rate / 1e9:.2f} GB/s", ""),
        (f"memory copy ({device})", f"{copy_bps / 1e9:.2f} GB/s", ""),
        ("preprocess / memory copy", f"{ratio:.3f}", ">= 0.3 on CPU"),
        ("speed-up 1 -> 2 workers", f"{speedup:.2f}x", ">= 1.7x"),
        ("time 10 GiB / time 1 GiB", f"{growth:.2f}x", "<= 11x"),
        ("worker CPU 10 GiB / 1 GiB", f"{cpu_growth:.2f}x", "context"),
        ("worker CPU per GiB (2 workers)", f"{two['worker_cpu_s_per_gib']:.2f} s", "context"),
        ("sha256, one core", f"{sha / 1e9:.2f} GB/s", "context"),
        ("median task (2 workers)", f"{two['median_task_ms']:.0f} ms", ">= 100 ms"),
    ]
    if "two_workers_ram" in runs:
        ram = runs["two_workers_ram"]["bytes"] / runs["two_workers_ram"]["seconds"]
        rows.insert(3, ("same, output in RAM (/dev/shm)", f"{ram / 1e9:.2f} GB/s", ""))
        rows.insert(4, ("RAM output / memory copy", f"{ram / copy_bps:.3f}", "context"))
    result = {
        "backend": backend,
        "copy_gbps": copy_bps / 1e9,
        "preprocess_gbps": rate / 1e9,
        "ratio_to_copy": ratio,
        "speedup_1_to_2_workers": speedup,
        "time_10x_over_1x": growth,
        "worker_cpu_10x_over_1x": cpu_growth,
        "sha256_gbps_one_core": sha / 1e9,
        "runs": runs,
    }
    return "P2 preprocessing throughput", rows, result
