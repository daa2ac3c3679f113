"""The dask cluster factory: an existing scheduler, LocalCUDACluster on GPUs, else LocalCluster
(worker processes, or for a small dataset threads in this process: `local_kind`).

dask-cuda and CuPy come with the `gpu` extra only; without them (CPU installs) `auto` falls
back to a CPU LocalCluster. Both are imported only when a GPU cluster is asked for.
"""

import importlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import dask
import distributed
import numpy as np

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask_quiet import register_quiet_heartbeat
from trainflow.errors import ConfigError

Backend = Literal["numpy", "cupy"]

log = logging.getLogger(__name__)

# glibc malloc settings for the workers we start. dask's default (trim above 64 KiB, which also
# turns off glibc's adaptive mmap threshold) gives every MB-sized NumPy temporary fresh pages
# from the kernel: measured 5-10x slower block-wise array work. Keep such blocks in the heap.
_MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": 64 << 20, "MALLOC_MMAP_THRESHOLD_": 32 << 20}


THREADS_BELOW = 64 << 20
"""local_workers=auto: an array dataset known to be smaller than this (tasks.preprocess.size
`array_bytes`) is preprocessed by threads in the flow's process. Measured on the 2-core
machine: a worker process took ~1.5 CPU s of imports and ~1 s before its first task, more
than the whole tiny or demo dataset's work."""

LocalKind = Literal["processes", "threads"]


def local_kind(cfg: DaskConfig, dataset_bytes: int | None) -> LocalKind:
    """How a local CPU cluster for a dataset of `dataset_bytes` (None: unknown) runs."""
    if cfg.local_workers != "auto":
        return cfg.local_workers
    small = dataset_bytes is not None and dataset_bytes < THREADS_BELOW
    return "threads" if small and cfg.memory_limit == "auto" else "processes"


@contextmanager
def dask_client(
    cfg: DaskConfig, workdir: Path | None = None, dataset_bytes: int | None = None
) -> Iterator[tuple[distributed.Client, Backend]]:
    """Yield a connected client and the array backend its workers use; close both on exit.

    An external scheduler (cfg.address) is only disconnected from, never shut down. With
    cfg.executor=slurm the workers are Slurm jobs (cluster.dask_slurm), cancelled on exit; with
    a workdir (on a filesystem the nodes share) their logs go to workdir/dask-workers and the
    jobs are recorded in workdir/active_jobs for `trainflow cleanup` (else: a temporary folder).
    A local CPU cluster runs as `local_kind` says for a dataset of `dataset_bytes`.
    """
    with ExitStack() as stack:
        stack.enter_context(quiet_dask_logs())  # first in, last out: covers the shutdown too
        backend: Backend
        if cfg.executor == "slurm":
            from trainflow.cluster.dask_slurm import slurm_client

            folder = workdir or Path(tempfile.mkdtemp(prefix="trainflow-dask-"))
            jobs = stack.enter_context(slurm_client(cfg, folder, _MALLOC_ENV, workdir is not None))
            client, backend = jobs
        elif cfg.executor == "allocation":
            from trainflow.cluster.dask_srun import allocation_client

            folder = workdir or Path(tempfile.mkdtemp(prefix="trainflow-dask-"))
            client, backend = stack.enter_context(allocation_client(cfg, folder, _MALLOC_ENV))
        elif cfg.address:
            backend = "cupy" if cfg.backend == "gpu" else "numpy"
            client = stack.enter_context(distributed.Client(cfg.address))
        else:
            stack.enter_context(environment_kept())  # restored after the cluster closes
            # Workers in this process put a run's code snapshot first on its sys.path
            # (cluster.dask_snapshot): this process's own path is restored afterwards.
            stack.enter_context(sys_path_kept())
            with dask.config.set(_worker_environ()):
                cluster, backend = _local_cluster(cfg, local_kind(cfg, dataset_bytes))
            stack.enter_context(cluster)
            client = stack.enter_context(distributed.Client(cluster))
        register_quiet_heartbeat(client)  # a teardown race's traceback: only with --debug
        log.info("dask cluster ready: %s (backend %s)", client.dashboard_link, backend)
        yield client, backend


# Loggers whose INFO lines (scheduler, nanny and worker start/stop, client connections) would
# reach the flow log. `silence_logs` only lowers the StreamHandlers on "distributed" itself, and
# once Prefect has configured logging there are none: records propagate to Prefect's console
# handler on the root logger. Raising the loggers' own level stops them at the source.
_NOISY_LOGGERS = ("distributed", "dask_cuda", "dask_jobqueue", "bokeh", "tornado")


@contextmanager
def quiet_dask_logs(level: int = logging.WARNING) -> Iterator[None]:
    """Keep dask's INFO chatter out of our logs (warnings and errors still pass); restore after."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    # Children with a level of their own (dask's config may set some) would bypass the parent's.
    loggers += [
        lg
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
        and name.startswith(tuple(f"{n}." for n in _NOISY_LOGGERS))
        and logging.NOTSET < lg.level < level
    ]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.getEffectiveLevel()))
    try:
        yield
    finally:
        for lg, old in zip(loggers, before, strict=True):
            lg.setLevel(old)


@contextmanager
def environment_kept() -> Iterator[None]:
    """Put back, on exit, the environment variables changed in this block.

    A local cluster's nannies run in this process and set their workers' settings
    (`distributed.nanny.pre-spawn-environ`: OMP/MKL/OPENBLAS_NUM_THREADS=1 and the malloc
    thresholds) in this process's os.environ before each worker starts, and leave them there:
    every process the flow starts afterwards (training ranks, a sweep's next pipeline, a
    `trainflow run` a test starts) inherited the dask workers' one thread and malloc tuning."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in [k for k in os.environ if k not in before]:
            del os.environ[name]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


@contextmanager
def sys_path_kept() -> Iterator[None]:
    """Put back, on exit, this process's sys.path as it was."""
    before = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = before


def workers_line(client: distributed.Client) -> str:
    """What the client's cluster runs on, for the log: '4 threads in this process', or '2
    worker processes, 2 threads, <dashboard link>'."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    threads = _count(sum(int(w["nthreads"]) for w in workers.values()), "thread")
    if workers and all(addr.startswith("inproc://") for addr in workers):
        return f"{threads} in this process"
    return f"{_count(len(workers), 'worker process')}, {threads}, {client.dashboard_link}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def _worker_environ() -> dict[str, Any]:
    """dask config that sets _MALLOC_ENV in worker processes before they start."""
    return {f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in _MALLOC_ENV.items()}


def _local_cluster(cfg: DaskConfig, kind: LocalKind) -> tuple[Any, Backend]:
    """Start a CUDA cluster when asked or possible, else a CPU LocalCluster of `kind`."""
    if cfg.backend in ("auto", "gpu"):
        try:
            return _cuda_cluster(cfg), "cupy"
        # NVML, CUDA runtime and import failures all mean the same thing here: no usable GPU.
        except Exception as exc:
            if cfg.backend == "gpu":
                raise ConfigError(
                    f"cluster.dask.backend='gpu' but no GPU cluster could start "
                    f"({type(exc).__name__}: {exc}); on a GPU machine install the gpu extra "
                    "(dask-cuda, CuPy: `make setup GPU=1`), or set cluster.dask.backend='auto' "
                    "or 'cpu'"
                ) from exc
            log.info("no GPU cluster (%s: %s); using a CPU LocalCluster", type(exc).__name__, exc)
    if kind == "threads":
        # One worker in this process: no memory limit (it would count the flow's own memory,
        # torch and all, and pause the worker), no network (inproc transport). The scheduler's
        # HTTP routes take a free port as the processes' do (None means dask's :8787, taken by
        # a second run on the machine: a warning in the flow's output).
        cluster = distributed.LocalCluster(
            n_workers=1,
            threads_per_worker=cfg.n_workers * cfg.threads_per_worker,
            processes=False,
            dashboard_address=":0",
            memory_limit=0,
            silence_logs=logging.WARNING,
        )
        return cluster, "numpy"
    cluster = distributed.LocalCluster(
        n_workers=cfg.n_workers,
        threads_per_worker=cfg.threads_per_worker,
        processes=True,
        host="127.0.0.1",
        dashboard_address=":0",
        memory_limit=cfg.memory_limit,
        silence_logs=logging.WARNING,  # scheduler/nanny INFO lines drown the pipeline's own
    )
    return cluster, "numpy"


def _cuda_cluster(cfg: DaskConfig) -> Any:
    """One dask-cuda worker per visible GPU; raises when there is none."""
    cupy = importlib.import_module("cupy")
    from dask_cuda import LocalCUDACluster

    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no CUDA device visible")
    return LocalCUDACluster(
        host="127.0.0.1",
        dashboard_address=":0",
        memory_limit=cfg.memory_limit,
        silence_logs=logging.WARNING,
    )


def array_module(backend: str) -> ModuleType:
    """The array module of a backend: numpy, or cupy (imported only when asked for)."""
    if backend == "cupy":
        return importlib.import_module("cupy")
    if backend == "numpy":
        return np
    raise ValueError(f"unknown array backend {backend!r}: expected 'numpy' or 'cupy'")


def to_numpy(arr: Any) -> np.ndarray:
    """A host numpy array from a numpy or cupy array (cupy copies device -> host)."""
    if type(arr).__module__.startswith("cupy"):
        return np.asarray(arr.get())
    return np.asarray(arr)
