"""The submitit executor factory: where a job runs. Knows nothing of training."""

from pathlib import Path

import submitit

from cluster.config import ClusterConfig


def make_executor(cfg: ClusterConfig, folder: Path) -> submitit.Executor:
    """The executor cfg.executor names, with the job's resources set.

    The class is chosen explicitly: submitit's AutoExecutor would pick Slurm whenever
    `sbatch` happens to be on the PATH.
    """
    if cfg.executor == "debug":
        # Runs the callable in this process when the result is asked for: one rank, no logs.
        return submitit.DebugExecutor(folder)
    executor = submitit.LocalExecutor(folder)
    executor.update_parameters(
        nodes=1,
        tasks_per_node=cfg.ranks_per_node,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task,
        timeout_min=cfg.timeout_min,
    )
    return executor
