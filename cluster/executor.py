"""The submitit executor factory: where a job runs. Knows nothing of training."""

import math
import shlex
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.job_environment import rank_launch
from trainflow.cluster.job_folder import prepare_job_folder, private_umask, seal_files
from trainflow.cluster.srun_executor import AllocationExecutor
from trainflow.compat import SubmititCommandHooks

SUBMITIT_MAX_TIMEOUTS = 10_000
"""submitit's own bound on requeues after a time limit: far above any job's need. Every job
(a single one, a job array's element, a search's task) counts only its attempts without
progress against cluster.max_requeues itself (tasks.train.limits.limit_requeue), so submitit would
otherwise fail a job that made progress at every limit after max_num_timeout of them."""


def make_executor(cfg: ClusterConfig, folder: Path) -> submitit.Executor:
    """The executor cfg.executor names, with the job's resources set.

    The class is chosen explicitly: submitit's AutoExecutor would pick Slurm whenever
    `sbatch` happens to be on the PATH. The folder is made private first, and jobs are
    submitted under umask 077 (cluster.job_folder).
    """
    prepare_job_folder(folder)
    if cfg.executor == "debug":
        # Runs the callable in this process when the result is asked for: one rank, no logs.
        return submitit.DebugExecutor(folder)
    if cfg.executor == "slurm":
        return _slurm_executor(cfg, folder)
    if cfg.executor == "allocation":
        return _allocation_executor(cfg, folder)
    restore_sigint()
    executor = TrainflowLocalExecutor(folder, max_num_timeout=SUBMITIT_MAX_TIMEOUTS)
    executor.peer_timeout_s = cfg.peer_timeout_s
    executor.update_parameters(
        nodes=1,
        tasks_per_node=cfg.ranks_per_node,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task,
        timeout_min=cfg.timeout_min,
    )
    return executor


def _guarded(command: str, python: str, peer_timeout_s: int) -> str:
    """`command` (a rank's command line) run under cluster.rank_guard, which records how the
    rank ended (exit code or signal) for cluster.lost_ranks and gives the rank its collective
    timeout. `python` is already quoted."""
    return (
        f"{python} -u -m trainflow.cluster.rank_guard --peer-timeout-s {peer_timeout_s} {command}"
    )


def _privately(folder: Path, submit: Callable[[], list[submitit.Job[Any]]]) -> list[Any]:
    """Submit under umask 077 (the job's processes inherit it), then tighten what is there."""
    with private_umask():
        jobs = submit()
    seal_files(folder)
    return jobs


class _GuardedPrivate(SubmititCommandHooks):
    """What trainflow adds to a submitit executor: every rank runs under cluster.rank_guard,
    and jobs are submitted privately (umask 077: pickles, logs and job processes). submitit
    takes both through trainflow.compat.SubmititCommandHooks."""

    peer_timeout_s: int = ClusterConfig().peer_timeout_s
    launch_prefix: str = ""
    """Before the rank's command (a container runtime's `exec`: cluster.job_environment)."""
    folder: Path
    python: str

    def task_command(self) -> str:
        """submitit's `<python> -u -m submitit.core._submit <folder>`, through our entry that
        shields rank 0's requeue first (cluster.rank_main), under the guard."""
        command = f"{self.python} -u -m trainflow.cluster.rank_main {shlex.quote(str(self.folder))}"
        guarded = _guarded(command, self.python, self.peer_timeout_s)
        return f"{self.launch_prefix} {guarded}" if self.launch_prefix else guarded

    def submitting(self, submit: Callable[[], list[Any]]) -> list[Any]:
        """Submit privately (umask 077), then tighten what is in the folder."""
        return _privately(self.folder, submit)


class TrainflowLocalExecutor(_GuardedPrivate, submitit.LocalExecutor):
    """submitit's LocalExecutor with guarded ranks and private job files."""


class TrainflowAllocationExecutor(_GuardedPrivate, AllocationExecutor):
    """AllocationExecutor (one srun step of the flow's own Slurm job) with guarded ranks and
    private job files (srun hands the umask on to the ranks)."""


class TrainflowSlurmExecutor(_GuardedPrivate, submitit.SlurmExecutor):
    """submitit's SlurmExecutor with guarded ranks (srun tasks) and private jobs: sbatch runs
    under umask 077, which Slurm hands on to the job (SLURM_UMASK), so its logs and result
    pickles are private too."""


def restore_sigint() -> None:
    """Un-ignore SIGINT in this process, so the local job controllers it starts obey it.

    A shell starts background commands (`cmd &`, nohup) with SIGINT ignored, and an ignored
    signal stays ignored across fork and exec: the controller of a local job would then
    survive the SIGINT that submitit's `cancel()` and `trainflow cleanup` send, and its ranks
    would train on. Only the main thread may change handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _slurm_executor(cfg: ClusterConfig, folder: Path) -> submitit.SlurmExecutor:
    """A SlurmExecutor whose sbatch options come from cfg (checked by cluster.slurm_checks)."""
    launch = rank_launch(cfg.container, folder, cfg.gpus_per_node)
    executor = TrainflowSlurmExecutor(
        folder, max_num_timeout=SUBMITIT_MAX_TIMEOUTS, python=launch.python
    )
    executor.peer_timeout_s = cfg.peer_timeout_s
    executor.launch_prefix = launch.prefix
    executor.update_parameters(**slurm_parameters(cfg), srun_args=launch.srun_args)
    return executor


def _allocation_executor(cfg: ClusterConfig, folder: Path) -> AllocationExecutor:
    """The ranks as one srun step over the nodes of the Slurm job this process runs in."""
    executor = TrainflowAllocationExecutor(folder)
    executor.peer_timeout_s = cfg.peer_timeout_s
    executor.update_parameters(
        nodes=cfg.nodes,
        tasks_per_node=cfg.ranks_per_node,
        cpus_per_task=cfg.cpus_per_task,
        gpus_per_node=cfg.gpus_per_node,
        timeout_min=cfg.timeout_min,
    )
    return executor


def slurm_parameters(cfg: ClusterConfig) -> dict[str, Any]:
    """SlurmExecutor.update_parameters arguments (sbatch option names) for cfg."""
    params: dict[str, Any] = {
        "nodes": cfg.nodes,
        "ntasks_per_node": cfg.ranks_per_node,
        "cpus_per_task": cfg.cpus_per_task,
        "time": cfg.timeout_min,
        "signal_delay_s": cfg.signal_delay_s,
        "job_name": "trainflow-train",
    }
    if cfg.gpus_per_node:
        params["gpus_per_node"] = cfg.gpus_per_node
    if cfg.mem_gb is not None:
        # Whole MiB (Slurm's "M"): submitit's own "16GB" form rounds fractional sizes down.
        params["mem"] = f"{math.ceil(cfg.mem_gb * 1024)}M"
    optional = {"partition": cfg.partition, "account": cfg.account, "qos": cfg.qos}
    params |= {k: v for k, v in optional.items() if v is not None}
    if cfg.setup:
        params["setup"] = list(cfg.setup)
    if cfg.sbatch_extra:
        # Underscored like submitit's own keys: job-name then replaces ours instead of adding one.
        params["additional_parameters"] = {
            k.replace("-", "_"): v for k, v in cfg.sbatch_extra.items()
        }
    return params
