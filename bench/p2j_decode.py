"""P2j: JPEG folder decoding on the dask workers, 1 -> 2 CPU workers, and GPU against CPU.

- Input: 20,000 generated 256x256 RGB JPEGs (~20-25 KB each) in 10 class folders, resized to
  64x64 (preprocess.image_size), cached under the system temp dir between runs.
- Baseline: one process decoding, converting and resizing files with PIL (the CPU path's own
  function), on 4,000 of the files: one core's ceiling.
- The real stage (`run_preprocess`: list, header probe, split, decode on the workers, uint8
  shards with sha256, manifest) on a CPU LocalCluster of 1 and 2 workers: images/s.
- On a GPU machine (a CUDA dask cluster starts): the same stage with GPU decode against the CPU
  path on all the machine's cores.
- Peak RSS (VmHWM) of this (flow) process and of a worker.
"""

import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.tasks.preprocess.config import PreprocessConfig
from trainflow.tasks.preprocess.run import run_preprocess
from trainflow.tasks.preprocess.sources import fingerprint
from trainflow.tasks.preprocess.worker_sources import FolderImages, list_folder

FILES = 20_000
CLASSES = 10
SIZE = (64, 64)
BASELINE_FILES = 4_000
CACHE = Path(tempfile.gettempdir()) / "trainflow-p2j-jpegs-v1"


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Measure P2j and return (title, rows, result)."""
    root = _jpegs()
    listing = list_folder(root)
    images = FolderImages(tuple(listing.files), 3, SIZE, resize=True)
    start = time.perf_counter()
    for name in listing.files[:BASELINE_FILES]:
        images.decode_cpu(name)
    pil_rate = BASELINE_FILES / (time.perf_counter() - start)
    cfg = PreprocessConfig(source="folder", path=root, image_size=SIZE)
    rates, worker_peak = {}, 0
    with tempfile.TemporaryDirectory(prefix="trainflow-p2j-") as scratch:
        for workers in (1, 2):
            dask = DaskConfig(backend="cpu", n_workers=workers)
            rate, peak = _stage_rate(cfg, dask, Path(scratch) / f"cpu{workers}")
            rates[f"cpu_{workers}"], worker_peak = rate, max(worker_peak, peak)
        gpu = _gpu_rates(cfg, Path(scratch))
    flow_peak = _vm_hwm()
    speedup = rates["cpu_2"] / rates["cpu_1"]
    rows = [
        ("PIL, 1 process (one core's ceiling)", f"{pil_rate:.0f} img/s", ""),
        ("stage, 1 CPU worker", f"{rates['cpu_1']:.0f} img/s", ""),
        ("stage, 2 CPU workers", f"{rates['cpu_2']:.0f} img/s", ""),
        ("speed-up 1 -> 2 workers", f"{speedup:.2f}x", ">= 1.7x"),
        ("2 workers / PIL in 1 process", f"{rates['cpu_2'] / pil_rate:.2f}x", ""),
        ("GPU decode / CPU on all cores", gpu.get("ratio_text", "not run: no GPU"), ">= 3x"),
        ("peak RSS flow process / worker", f"{flow_peak >> 20} / {worker_peak >> 20} MiB", ""),
    ]
    result = {
        "files": FILES,
        "pil_one_process_img_s": round(pil_rate, 1),
        "stage_img_s": {k: round(v, 1) for k, v in rates.items()},
        "speedup_1_to_2_workers": round(speedup, 3),
        "gpu": gpu,
        "peak_rss_flow_bytes": flow_peak,
        "peak_rss_worker_bytes": worker_peak,
        "load_average": os.getloadavg()[0],
    }
    return f"P2j JPEG folder decode ({FILES} files 256x256 -> 64x64)", rows, result


def _stage_rate(cfg: PreprocessConfig, dask: DaskConfig, out: Path) -> tuple[float, int]:
    """Images/s of run_preprocess on a fresh cluster (started beforehand), and a worker's peak."""
    with dask_client(dask) as (client, backend):
        start = time.perf_counter()
        run_preprocess(cfg, out, client, backend, fingerprint(cfg))
        elapsed = time.perf_counter() - start
        peaks = client.run(_vm_hwm)
    return FILES / elapsed, max(peaks.values())


def _gpu_rates(cfg: PreprocessConfig, scratch: Path) -> dict[str, Any]:
    """GPU decode against the CPU path on all cores, where a CUDA dask cluster starts."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
    except ImportError:
        return {}
    gpu_rate, _ = _stage_rate(cfg, DaskConfig(backend="gpu"), scratch / "gpu")
    cores = os.cpu_count() or 1
    cpu_rate, _ = _stage_rate(cfg, DaskConfig(backend="cpu", n_workers=cores), scratch / "all")
    ratio = gpu_rate / cpu_rate
    return {
        "gpu_img_s": round(gpu_rate, 1),
        "cpu_all_cores_img_s": round(cpu_rate, 1),
        "cores": cores,
        "ratio": round(ratio, 3),
        "ratio_text": f"{ratio:.2f}x",
    }


def _vm_hwm() -> int:
    """This process's peak resident set (bytes), from /proc (reset at exec, unlike ru_maxrss)."""
    match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match[1]) * 1024 if match else 0


def _jpegs() -> Path:
    """The cached folder of generated JPEGs (made once, in 2 processes)."""
    done = CACHE / ".complete"
    if done.exists():
        return CACHE
    for label in range(CLASSES):
        (CACHE / f"class{label}").mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(_write_jpeg, range(FILES), chunksize=500))
    done.touch()
    return CACHE


def _write_jpeg(i: int) -> None:
    """A smooth colour pattern with some noise: ~20-25 KB at quality 90."""
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:256, 0:256]
    base = np.stack([xx * (i % 7 + 1), yy * (i % 5 + 1), (xx + yy) * (i % 3 + 1)], -1) // 4
    pixels = (base + rng.integers(0, 24, (256, 256, 3))) % 256
    path = CACHE / f"class{i % CLASSES}" / f"{i:06d}.jpg"
    Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
