"""System metrics per node in the train run, sampled with psutil (and NVML on GPU nodes) under
MLflow's own system metric names, written to the job's journal (tasks.tracking.journal).

One sampler per node, in the node's local rank 0, named by the node: Slurm's node name
(SLURMD_NODENAME: nodes of one cluster may share a hostname, as the dev cluster's do), else the
host name. Its points are ``system/<node>/cpu_utilization_percentage``, ``.../system_memory_
usage_percentage``, disk and network, and on GPU nodes ``.../gpu_<i>_utilization_percentage``
and ``.../gpu_<i>_memory_usage_percentage`` for the job's own GPUs only: ``i`` counts the GPUs
Slurm gave the job on that node. MLflow's UI shows them in the run's System metrics tab.

No rank imports MLflow for them (MLflow's own monitor did: ~1.5 s of start-up on every node),
and a tracking outage cannot touch the sampler: the flow sends its points.
"""

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from trainflow.console import say
from trainflow.tasks.tracking.journal import Journal, count_records

STOP_WAIT_S = 10.0
"""How long the end of a job waits for the sampling thread."""
_GPU_LIST_VARIABLES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


def node_name() -> str:
    """This node's name: SLURMD_NODENAME on Slurm, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def job_gpus(env: dict[str, str] | None = None) -> list[str] | None:
    """The GPUs (indices or UUIDs) the scheduler gave this job on this node; None: all."""
    env = dict(os.environ) if env is None else env
    for name in _GPU_LIST_VARIABLES:
        value = env.get(name, "").strip()
        if value and value not in ("NoDevFiles", "none"):
            return [v.strip() for v in value.split(",") if v.strip()]
    return None


@contextmanager
def node_monitor(out_dir: Path | None, local_rank: int, interval_s: float) -> Iterator[str | None]:
    """Sample this node's system metrics into its journal every `interval_s` while the block
    runs, and once more at its end (a job shorter than one interval still shows a point);
    yields the node name they go under (None: no sampler here: another local rank, no run
    (out_dir None), or interval 0)."""
    if out_dir is None or local_rank != 0 or interval_s <= 0:
        yield None
        return
    node = node_name()
    sampler = _Sampler(Journal(out_dir, f"node-{node}"), node, interval_s)
    sampler.start()
    say(f"system metrics of node {node} every {interval_s:g} s")
    try:
        yield node
    finally:
        sampler.finish()


class _Sampler(threading.Thread):
    """The sampling thread; a sample that cannot be taken or written is one warning line."""

    def __init__(self, journal: Journal, node: str, interval_s: float) -> None:
        super().__init__(name="system-metrics", daemon=True)
        self._journal, self._node, self._interval_s = journal, node, interval_s
        self._done = threading.Event()
        self._step = count_records(journal.path)  # a requeued job continues the steps
        self._warned = False
        self._gpus = _gpu_handles(job_gpus())
        self._net0 = psutil.net_io_counters()
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def run(self) -> None:
        while not self._done.wait(self._interval_s):
            self._sample()

    def finish(self) -> None:
        """Stop sampling, write the closing sample, close the journal."""
        self._done.set()
        self.join(STOP_WAIT_S)
        self._sample()
        self._journal.close()

    def _sample(self) -> None:
        try:
            ts = int(time.time() * 1000)
            prefix = f"system/{self._node}/"
            self._journal.metrics(
                (prefix + key, value, ts, self._step) for key, value in self._values().items()
            )
            self._step += 1
        except Exception as exc:  # metrics are an extra: training goes on without them
            if not self._warned:
                say(f"warning: system metrics of node {self._node}: {exc}")
                self._warned = True

    def _values(self) -> dict[str, float]:
        mb = 1 << 20
        memory, disk = psutil.virtual_memory(), psutil.disk_usage("/")
        net = psutil.net_io_counters()
        values = {
            "cpu_utilization_percentage": psutil.cpu_percent(interval=None),
            "system_memory_usage_megabytes": (memory.total - memory.available) / mb,
            "system_memory_usage_percentage": memory.percent,
            "disk_usage_percentage": disk.percent,
            "disk_usage_megabytes": disk.used / mb,
            "disk_available_megabytes": disk.free / mb,
            "network_receive_megabytes": (net.bytes_recv - self._net0.bytes_recv) / mb,
            "network_transmit_megabytes": (net.bytes_sent - self._net0.bytes_sent) / mb,
        }
        for i, (nvml, handle) in enumerate(self._gpus):
            use = nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            values[f"gpu_{i}_utilization_percentage"] = float(use.gpu)
            values[f"gpu_{i}_memory_usage_percentage"] = 100.0 * mem.used / max(mem.total, 1)
            values[f"gpu_{i}_memory_usage_megabytes"] = mem.used / mb
        return values


def _gpu_handles(gpus: list[str] | None) -> list[tuple[Any, Any]]:
    """NVML handles of the job's GPUs (all of the host's when the scheduler names none); none
    where NVML (nvidia-ml-py) is missing or finds no driver. `i` in the metric names counts
    the job's GPUs on the node."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if gpus is None:
            gpus = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return [(pynvml, _gpu_handle(pynvml, g)) for g in gpus]
    except Exception:
        return []


def _gpu_handle(pynvml: Any, gpu: str) -> Any:
    """NVML's handle of a GPU named by index or UUID (as Slurm and CUDA name them)."""
    if gpu.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
    return pynvml.nvmlDeviceGetHandleByUUID(gpu)
