"""dask workers as an `srun` step of the Slurm job this process runs in (executor=allocation).

For a pipeline that runs inside one multi-node allocation (deploy/slurm/pipeline.sbatch with
--nodes > 1): the scheduler runs in the flow's process on the job's first node, and one step
(`srun --overlap`, so it shares the CPUs the batch step holds) starts n_workers workers spread
over the allocation's nodes; no new job is queued. The step ends with the block: srun passes
our SIGTERM to the workers, and a step still there after STOP_WAIT_S is scancelled.
"""

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import distributed

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask_slurm import DEATH_TIMEOUT_S, Backend, scheduler_host
from trainflow.cluster.dask_slurm_checks import worker_mem_mb
from trainflow.errors import ConfigError, JobError

log = logging.getLogger(__name__)
STOP_WAIT_S = 30


@contextmanager
def allocation_client(
    cfg: DaskConfig, workdir: Path, env: Mapping[str, object] | None = None
) -> Iterator[tuple[distributed.Client, Backend]]:
    """Start the workers as one srun step of this job, wait for them, yield a client."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError(
            "cluster.dask.executor=allocation starts the workers inside this process's Slurm "
            "job, but it runs in none (no SLURM_JOB_ID): run it in an sbatch/salloc job "
            "(deploy/slurm/pipeline.sbatch), or set cluster.dask.executor=slurm or local"
        )
    log_dir = workdir / "dask-workers"
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"trainflow-dask-{uuid.uuid4().hex[:8]}"
    host = cfg.scheduler_host or scheduler_host()
    scheduler_only = distributed.LocalCluster(
        n_workers=0,
        host=host,
        scheduler_port=0,
        dashboard_address=":0",
        silence_logs=logging.WARNING,
    )
    with scheduler_only as cluster:
        argv = srun_argv(cfg, cluster.scheduler_address, name, log_dir)
        child_env = {**os.environ, **{k: str(v) for k, v in env.items()}} if env else None
        with (log_dir / f"{name}-srun.log").open("ab") as srun_log:  # srun's own messages
            step = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=srun_log, stderr=srun_log, env=child_env
            )
        try:
            with distributed.Client(cluster) as client:
                _wait(client, step, cfg, log_dir / f"{name}-0.log")
                yield client, "cupy" if cfg.gpus_per_worker else "numpy"
        finally:
            stop_step(step, job_id, name)


def srun_argv(cfg: DaskConfig, address: str, name: str, log_dir: Path) -> list[str]:
    """The srun command of the worker step: n_workers tasks over the allocation's nodes."""
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    gpu = cfg.gpus_per_worker > 0
    argv = ["srun", f"--job-name={name}", "--overlap", "--kill-on-bad-exit=1"]
    argv += [f"--nodes={min(nodes, cfg.n_workers)}", f"--ntasks={cfg.n_workers}"]
    argv += [f"--cpus-per-task={cfg.cpus_per_worker}"]  # memory: the job's (and --memory-limit)
    argv += [f"--gpus-per-task={cfg.gpus_per_worker}"] if gpu else []
    argv += [f"--output={log_dir}/{name}-%t.log"]
    argv += [sys.executable, "-m", "dask_cuda.cli" if gpu else "distributed.cli.dask_worker"]
    argv += [address, "--nthreads", str(cfg.threads_per_worker)]
    argv += ["--memory-limit", f"{worker_mem_mb(cfg)}MiB"]
    argv += ["--death-timeout", str(DEATH_TIMEOUT_S)]
    return argv


def _wait(
    client: distributed.Client, step: subprocess.Popen[bytes], cfg: DaskConfig, log0: Path
) -> None:
    """Until n_workers are connected; JobError if the step ends first or the time runs out."""
    deadline = time.monotonic() + cfg.start_timeout_s
    while len(client.scheduler_info(n_workers=-1)["workers"]) < cfg.n_workers:
        if step.poll() is not None:
            tail = log0.read_text(errors="replace")[-2000:] if log0.exists() else "(no log)"
            raise JobError(
                f"the dask worker step (srun) ended with status {step.returncode} before its "
                f"workers connected; the first worker's log ({log0}):\n{tail}"
            )
        if time.monotonic() > deadline:
            raise JobError(
                f"the dask worker step did not bring {cfg.n_workers} workers within "
                f"cluster.dask.start_timeout_s={cfg.start_timeout_s}: the allocation may lack "
                "the CPUs or memory for them (lower cluster.dask.n_workers, cpus_per_worker or "
                "mem_gb, or raise start_timeout_s)"
            )
        time.sleep(0.5)


def stop_step(step: subprocess.Popen[bytes], job_id: str, name: str) -> None:
    """SIGTERM to srun (passed on to the workers); scancel the step if it outlives STOP_WAIT_S."""
    if step.poll() is None:
        step.send_signal(signal.SIGTERM)
        try:
            step.wait(timeout=STOP_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            log.warning("the dask worker step outlived SIGTERM: cancelling it")
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True
    )
    steps = [line.split()[0] for line in out.stdout.splitlines() if line.endswith(f" {name}")]
    if steps:
        subprocess.run(["scancel", *steps], capture_output=True, check=False)
    if step.poll() is None:
        step.kill()
        step.wait()
