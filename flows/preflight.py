"""Every check that needs no server, cluster or job: run before any of them starts.

`trainflow run` and `trainflow sweep` call this right after building the config, so a wrong path,
a malformed file list or an unreachable Slurm reports in about a second, alone; the flows call it
again first thing (a deployment run does not go through the command line).
"""

import os
from pathlib import Path

from trainflow.cluster.dask_slurm_checks import check_dask_workers
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.flows.config import PipelineConfig
from trainflow.tasks.diskspace import require_space
from trainflow.tasks.errors import ConfigError
from trainflow.tasks.preprocess.preflight import preflight_source
from trainflow.tasks.preprocess.size import preprocess_need


def preflight(cfg: PipelineConfig) -> None:
    """ConfigError or DataError (what is wrong and the fix) before any expensive work."""
    check_workdir(cfg.workdir)
    preflight_source(cfg.preprocess)
    datasets = cfg.workdir / "datasets"  # a dataset the workdir's disk cannot hold: now
    require_space("preprocess", datasets, preprocess_need(cfg.preprocess, datasets))
    check_cluster(cfg.cluster)  # a Slurm request that can never run, or no Slurm to reach
    check_dask_workers(cfg.cluster.dask)  # the same for dask worker jobs


def check_workdir(workdir: Path) -> None:
    """The workdir is a folder we can write, or can be created where we can write."""
    target = workdir.resolve()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"workdir {str(workdir)!r}: {str(existing)!r} is a file, not a folder: "
            "set workdir=<a folder>"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "workdir" if existing == target else f"workdir's parent {str(existing)!r}"
        raise ConfigError(
            f"cannot write to the {what} ({str(workdir)!r}): pick a workdir you can write "
            "(--set workdir=...) or fix its permissions"
        )
