"""Every check that needs no server, cluster or job: run before any of them starts.

`trainflow run` and `trainflow sweep` call this right after building the config, before Prefect
starts, so a wrong path, a malformed file list, a model plug-in that does not import, build or
fit the data, or an unreachable Slurm reports in seconds, alone; they hand the config and the
check's report to the flow. A deployment run (which does not go through the command line)
checks first thing in its flow.
"""

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from trainflow.cluster.dask_slurm_checks import check_dask_workers
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.errors import ConfigError
from trainflow.flows.config import PipelineConfig
from trainflow.tasks.diskspace import require_space
from trainflow.tasks.preprocess.preflight import preflight_source, probe_spec
from trainflow.tasks.preprocess.size import preprocess_need
from trainflow.tasks.train.batching import data_ranks
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_report import ModelReport
from trainflow.tasks.train.parallel.layout import MeshShape, job_shape

if TYPE_CHECKING:  # check_code imports torch (seconds), check_inputs does not
    from torch import nn

    from trainflow.tasks.spec import DataSpec


def preflight(cfg: PipelineConfig, sweep: Iterable[TrainConfig] = ()) -> ModelReport:
    """ConfigError or DataError (what is wrong and the fix) before any expensive work; what
    the model check found (built on the meta device: nothing allocated). `sweep`: the train
    configs of a sweep's elements, whose models are checked against the same data."""
    return check_code(cfg, check_inputs(cfg), sweep)


def check_inputs(cfg: PipelineConfig) -> "DataSpec":
    """The checks that import neither torch nor a model: the workdir, the global batch on the
    job's ranks, the data source and its probe, the disk space the dataset needs, the Slurm
    requests; the data's spec. `trainflow run` calls this before it imports torch or starts
    any process, so bad data is refused in about a second on an idle machine, alone."""
    check_workdir(cfg.workdir)
    check_global_batch(cfg.train, cfg)  # the world size is known here, not in TrainConfig
    preflight_source(cfg.preprocess)
    spec = probe_spec(cfg.preprocess, cfg.train.objective)
    datasets = cfg.workdir / "datasets"  # a dataset the workdir's disk cannot hold: now
    require_space("preprocess", datasets, preprocess_need(cfg.preprocess, datasets))
    check_cluster(cfg.cluster)  # a Slurm request that can never run, or no Slurm to reach
    check_dask_workers(cfg.cluster.dask)  # the same for dask worker jobs
    return spec


def check_code(
    cfg: PipelineConfig, spec: "DataSpec", sweep: Iterable[TrainConfig] = ()
) -> ModelReport:
    """The checks that import torch and the user's code: the objective against the data (and
    train.monitor against the objective's metrics), the model (and each sweep element's) built
    on the meta device and its optimizer built over it, the code snapshot's size."""
    from trainflow.cluster.snapshot import plan_snapshot
    from trainflow.tasks.objectives import check_data
    from trainflow.tasks.train.model_plugins import checked_model
    from trainflow.tasks.train.monitor import check_monitor
    from trainflow.tasks.train.optimizers import check_optimizer

    objective_args = cfg.train.objective_args
    objective = check_data(cfg.train.objective, objective_args, spec)  # objective vs data
    check_monitor(cfg.train, objective)  # train.monitor names one of its metrics
    model, meta = checked_model(cfg.train, spec)  # the user's factory runs once per config
    check_optimizer(cfg.train, spec, meta)
    check_split(cfg.train, cfg, meta)
    check_init_from(cfg, meta)
    for train in sweep:
        check_global_batch(train, cfg)
        if (train.objective, train.objective_args) == (cfg.train.objective, objective_args):
            check_monitor(train, objective)
        built = checked_model(train, spec)[1]
        check_optimizer(train, spec, built)
        check_split(train, cfg, built)
    plan_snapshot(user_modules(cfg, model))  # a code folder too big to snapshot
    return model


def check_global_batch(train: TrainConfig, cfg: PipelineConfig) -> None:
    """train.parallel lays out the training job's ranks (cluster.nodes x
    cluster.ranks_per_node), and train.global_batch_size makes up whole micro-batches on its
    data-parallel ranks: ConfigError naming the values that would."""
    data_ranks(train, job_mesh(train, cfg).dp)


def job_mesh(train: TrainConfig, cfg: PipelineConfig) -> MeshShape:
    """The mesh of `train`'s job on the cluster's ranks (ConfigError when it does not fit)."""
    world = cfg.cluster.nodes * cfg.cluster.ranks_per_node
    return job_shape(train.strategy, train.parallel, world)


def check_split(train: TrainConfig, cfg: PipelineConfig, model: "nn.Module") -> None:
    """With train.parallel.tp above 1, `model` (built on the meta device) has a
    tensor-parallel plan whose sizes divide by tp; with pp above 1, a cut into pp stages
    that holds each parameter once, its layers dividing by pp: ConfigError (one line)
    otherwise."""
    shape = job_mesh(train, cfg)
    if shape.tp > 1:
        from trainflow.tasks.train.parallel.tensor_parallel import tp_plan

        tp_plan(model, shape.tp)
    if shape.pp > 1:
        from trainflow.tasks.train.parallel.pipeline import check_stages

        check_stages(model, shape.pp)


def check_init_from(cfg: PipelineConfig, model: "nn.Module") -> None:
    """train.init_from's weights found and fitting `model` (cfg's, built on the meta device)."""
    if cfg.train.init_from is None:
        return
    from trainflow.tasks.train.init_from import check_fits, load_weights

    path = Path(str(initial_weights(cfg).init_from))
    check_fits(load_weights(path), model, path)


def initial_weights(cfg: PipelineConfig) -> "TrainConfig":
    """cfg.train with train.init_from resolved to the weights file the ranks load (a run id
    or a registered version is found here, where the workdir and the MLflow store are)."""
    if cfg.train.init_from is None:
        return cfg.train
    from trainflow.tasks.tracking.config import resolve_tracking_uri
    from trainflow.tasks.train.init_from import resolve

    uri = resolve_tracking_uri(cfg.tracking, cfg.workdir)
    path = resolve(cfg.train.init_from, cfg.workdir, uri)
    return cfg.train.model_copy(update={"init_from": str(path)})


def user_modules(cfg: PipelineConfig, model: ModelReport) -> list[str]:
    """The modules of the user's plug-ins (model, optimizer, data source) whose code the run
    snapshots (cluster.snapshot)."""
    from trainflow.tasks.plugins import resolve
    from trainflow.tasks.preprocess.plugin_source import BUILTINS
    from trainflow.tasks.preprocess.plugin_source import GROUP as SOURCE_GROUP
    from trainflow.tasks.train.optimizers import BUILTIN_OPTIMIZERS, resolve_optimizer

    modules = [model.module]
    if cfg.train.optimizer not in BUILTIN_OPTIMIZERS:  # ours are trainflow's: never snapshot
        modules.append(resolve_optimizer(cfg.train).target.partition(":")[0])
    if cfg.preprocess.is_plugin:  # a built-in's module is trainflow's: never snapshot
        source = resolve(
            cfg.preprocess.source,
            setting="preprocess.source",
            group=SOURCE_GROUP,
            builtins=BUILTINS,
        )
        modules.append(source.target.partition(":")[0])
    return modules


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
