"""System metrics per node in the train run, through MLflow's own monitor (psutil, pynvml).

One monitor per node, in the node's local rank 0, named by the node: Slurm's node name
(SLURMD_NODENAME: nodes of one cluster may share a hostname, as the dev cluster's do), else the
host name. Its points are ``system/<node>/cpu_utilization_percentage``, ``.../system_memory_
usage_percentage``, disk and network, and on GPU nodes ``.../gpu_<i>_utilization_percentage``
and ``.../gpu_<i>_memory_usage_percentage`` for the job's own GPUs only (MLflow's monitor
watches every GPU of the host): ``i`` counts the GPUs Slurm gave the job on that node.

A tracking outage never stops training: MLflow's monitor thread ends by itself when it cannot
reach the server, and stopping it waits at most ``STOP_WAIT_S``.
"""

import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_WAIT_S = 10.0
"""How long the end of a job waits for the monitor's last points."""
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
def node_monitor(
    tracking_uri: str | None, run_id: str | None, local_rank: int, interval_s: float
) -> Iterator[str | None]:
    """Run MLflow's system metrics monitor for this node while the block runs; yields the node
    name it logs under (None: no monitor here: another local rank, no run, or interval 0)."""
    if not (tracking_uri and run_id) or local_rank != 0 or interval_s <= 0:
        yield None
        return
    node = node_name()
    # Imported here, on this thread: the monitor, the metric sender and the tag thread import
    # parts of MLflow, and threads importing one package at once can see it half initialised.
    import_mlflow_parts()
    started: list[Any] = []
    # Started on a thread: resuming reads the run's last step from the server, and a server
    # that is down must not hold up training.
    starter = threading.Thread(
        target=lambda: started.append(_start(tracking_uri, run_id, node, interval_s)),
        name="system-metrics-start",
        daemon=True,
    )
    starter.start()
    try:
        yield node
    finally:
        starter.join(STOP_WAIT_S)
        if started and started[0] is not None:
            _stop(started[0])


def import_mlflow_parts() -> None:
    """Import what the threads of this module use (call before starting them)."""
    import mlflow.entities
    import mlflow.system_metrics.system_metrics_monitor
    import mlflow.tracking  # noqa: F401


def _start(tracking_uri: str, run_id: str, node: str, interval_s: float) -> Any:
    """A started monitor, or None (with one line saying why) when it cannot start."""
    # Imported here: only one rank per node pays for MLflow's import.
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # start/stop chatter
    try:
        monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=interval_s,
            samples_before_logging=1,
            resume_logging=True,  # a requeued job continues the steps, no second series
            node_id=node,
            tracking_uri=tracking_uri,
        )
        _keep_job_gpus(monitor, job_gpus())
        monitor.start()
    except Exception as exc:  # the monitor is an extra: training goes on without it
        print(
            f"warning: no system metrics for node {node}: {type(exc).__name__}: {exc}", flush=True
        )
        return None
    print(f"system metrics of node {node} every {interval_s:g} s", flush=True)
    return monitor


def _keep_job_gpus(monitor: Any, gpus: list[str] | None) -> None:
    """Have MLflow's GPU monitor (if any) watch only `gpus` instead of the whole host."""
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

    for part in monitor.monitors:
        if isinstance(part, GPUMonitor) and gpus is not None:
            import pynvml

            part.gpu_handles = [_gpu_handle(pynvml, g) for g in gpus]
            part.num_gpus = len(part.gpu_handles)


def _gpu_handle(pynvml: Any, gpu: str) -> Any:
    """NVML's handle of a GPU named by index or UUID (as Slurm and CUDA name them)."""
    if gpu.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
    return pynvml.nvmlDeviceGetHandleByUUID(gpu)


def _stop(monitor: Any) -> None:
    """Stop the monitor, sending its last points; never wait longer than STOP_WAIT_S."""

    def finish() -> None:
        monitor.finish()
        # MLflow's loop drops the samples of its last, unfinished interval: a job shorter than
        # one interval would show nothing. Publish them as the node's closing point.
        try:
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception as exc:
            print(f"warning: last system metrics not logged: {type(exc).__name__}: {exc}")

    stopper = threading.Thread(target=finish, name="system-metrics-stop", daemon=True)
    stopper.start()
    stopper.join(STOP_WAIT_S)


def tag_in_background(tracking_uri: str, run_id: str, tags: dict[str, str]) -> None:
    """Set tags on a run from a daemon thread: training never waits; a failure is one line."""

    import_mlflow_parts()  # on this thread: see node_monitor
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    def send() -> None:
        try:
            batch = [RunTag(k, v) for k, v in tags.items()]
            MlflowClient(tracking_uri).log_batch(run_id, tags=batch)
        except Exception as exc:
            print(f"warning: tags {sorted(tags)} not set: {type(exc).__name__}: {exc}", flush=True)

    threading.Thread(target=send, name="run-tags", daemon=True).start()
