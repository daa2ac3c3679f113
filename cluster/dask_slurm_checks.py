"""Check the dask worker jobs of cluster.dask.executor=slurm against the real cluster.

The same facts as training requests (cluster.slurm_checks: `scontrol show partition|node`),
with messages that name the cluster.dask.* fields: a worker that no node can hold would pend
forever, so it is refused before anything is queued.
"""

import math

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.slurm_checks import Node, Partition, read_nodes, read_partitions
from trainflow.errors import ConfigError


def check_dask_workers(cfg: DaskConfig) -> None:
    """ConfigError when the cluster cannot run cfg's worker jobs; nothing for local workers."""
    if cfg.executor != "slurm":
        return
    try:
        partitions, nodes = read_partitions(), read_nodes()
    except ConfigError as err:  # its text is about cluster.executor: name the dask setting
        why = str(err).replace("cluster.executor=slurm, but ", "")
        why = why.replace("cluster.executor=local", "cluster.dask.executor=local")
        raise ConfigError(f"cluster.dask.executor=slurm needs Slurm, but {why}") from None
    check_workers_against(cfg, partitions, nodes)


def check_workers_against(cfg: DaskConfig, partitions: list[Partition], nodes: list[Node]) -> None:
    """check_dask_workers for given cluster facts (as read_partitions / read_nodes return them)."""
    part = _pick_partition(cfg, partitions)
    if part.max_time_min is not None and cfg.timeout_min > part.max_time_min:
        raise ConfigError(
            f"cluster.dask.timeout_min={cfg.timeout_min}, but partition {part.name!r} has "
            f"MaxTime {part.max_time_min} min: set cluster.dask.timeout_min<="
            f"{part.max_time_min} or choose another cluster.dask.partition"
        )
    members = [n for n in nodes if part.name in n.partitions]
    where = f"the largest node of partition {part.name!r}"
    most_cpus = _cap(max((n.cpus for n in members), default=0), part.max_cpus_per_node)
    if cfg.cpus_per_worker > most_cpus:
        raise ConfigError(
            f"cluster.dask.cpus_per_worker={cfg.cpus_per_worker}, but {where} offers "
            f"{most_cpus} CPUs: set cluster.dask.cpus_per_worker<={most_cpus} or choose "
            "another cluster.dask.partition"
        )
    mem_mb = worker_mem_mb(cfg)
    most_mem = _cap(max((n.mem_mb for n in members), default=0), part.max_mem_per_node_mb)
    if mem_mb > most_mem:
        raise ConfigError(
            f"cluster.dask.mem_gb={cfg.mem_gb} ({mem_mb} MiB per worker), but {where} offers "
            f"{most_mem} MiB: set cluster.dask.mem_gb<={math.floor(most_mem / 1024 * 100) / 100:g}"
            " or choose another cluster.dask.partition"
        )
    most_gpus = max((n.gpus for n in members), default=0)
    if cfg.gpus_per_worker > most_gpus:
        raise ConfigError(
            f"cluster.dask.gpus_per_worker={cfg.gpus_per_worker}, but {where} has {most_gpus} "
            f"GPU(s): set cluster.dask.gpus_per_worker<={most_gpus} (0: CPU workers) or choose "
            "a GPU cluster.dask.partition"
        )
    if not any(_fits(n, cfg, mem_mb) for n in members):
        raise ConfigError(
            f"no node of partition {part.name!r} offers {cfg.cpus_per_worker} CPUs, "
            f"{cfg.gpus_per_worker} GPU(s) and {mem_mb} MiB at once: lower "
            "cluster.dask.cpus_per_worker, gpus_per_worker or mem_gb"
        )


def worker_mem_mb(cfg: DaskConfig) -> int:
    """The --mem of one worker job in MiB (rounded up, as it is sent)."""
    return math.ceil(cfg.mem_gb * 1024)


def _pick_partition(cfg: DaskConfig, partitions: list[Partition]) -> Partition:
    names = ", ".join(p.name for p in partitions) or "(none)"
    if cfg.partition is None:
        default = next((p for p in partitions if p.default), None)
        if default is None:
            raise ConfigError(
                "cluster.dask.partition is not set and the cluster has no default partition: "
                f"set cluster.dask.partition to one of: {names}"
            )
        return default
    found = next((p for p in partitions if p.name == cfg.partition), None)
    if found is None:
        raise ConfigError(
            f"cluster.dask.partition={cfg.partition!r}: no such partition on this cluster; "
            f"set cluster.dask.partition to one of: {names}"
        )
    return found


def _cap(value: int, limit: int | None) -> int:
    return value if limit is None else min(value, limit)


def _fits(node: Node, cfg: DaskConfig, mem_mb: int) -> bool:
    return (
        node.cpus >= cfg.cpus_per_worker
        and node.mem_mb >= mem_mb
        and node.gpus >= cfg.gpus_per_worker
    )
