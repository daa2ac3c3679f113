"""Check a Slurm request against the real cluster before anything is queued.

Slurm accepts some impossible requests and lets them pend forever (e.g. more CPUs per task
than any node has: reason PartitionConfig), and rejects others only at sbatch time with a
terse message. Here each is a ConfigError naming the field, the value, what the cluster
offers and the fix. Facts come from ``scontrol show partition|node -o`` (one line per record,
``Key=Value`` pairs), which every Slurm version prints.
"""

import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.dev.slurm import slurm_conf
from trainflow.cluster.job_environment import check_image
from trainflow.errors import ConfigError

_NO_CLUSTER_FIX = (
    f"start a dev cluster with `trainflow cluster up` and export SLURM_CONF={slurm_conf()}, "
    "run on a machine that can submit to your Slurm cluster, or choose cluster.executor=local"
)
_LOCAL = "or choose cluster.executor=local"
# A key starts a new pair only after whitespace: values such as OS= or Reason= contain spaces.
_PAIR = re.compile(r"(?:^|\s)([A-Za-z][\w/:.]*)=")
_UNLIMITED = ("UNLIMITED", "INFINITE", "NONE", "")


@dataclass(frozen=True)
class Node:
    """What one node offers to a job."""

    name: str
    cpus: int
    mem_mb: int
    gpus: int
    partitions: tuple[str, ...]


@dataclass(frozen=True)
class Partition:
    """The limits of one partition (None: unlimited)."""

    name: str
    default: bool
    total_nodes: int
    max_nodes: int | None
    max_time_min: int | None
    max_cpus_per_node: int | None
    max_mem_per_node_mb: int | None


def check_request(cfg: ClusterConfig) -> None:
    """ConfigError when the cluster cannot run cfg's job: nothing is submitted then."""
    check_against(cfg, read_partitions(), read_nodes())


def check_against(cfg: ClusterConfig, partitions: list[Partition], nodes: list[Node]) -> None:
    """check_request for given cluster facts (as read_partitions / read_nodes return them)."""
    part = _pick_partition(cfg, partitions)
    _check_nodes(cfg, part)
    _check_time(cfg, part)
    _check_node_resources(cfg, part, [n for n in nodes if part.name in n.partitions])


def read_partitions() -> list[Partition]:
    """Every partition of the cluster SLURM_CONF (or the default config) names."""
    return [_partition(r) for r in scontrol_records("partition")]


def read_nodes() -> list[Node]:
    """Every node of the cluster."""
    return [_node(r) for r in scontrol_records("node")]


def scontrol_records(kind: str) -> list[dict[str, str]]:
    """`scontrol show <kind> -o` as one dict per record; ConfigError when Slurm is unusable."""
    if shutil.which("scontrol") is None:
        raise ConfigError(
            "cluster.executor=slurm, but the Slurm client tools (scontrol, sbatch) are not on "
            f"PATH: {_NO_CLUSTER_FIX}"
        )
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():  # scontrol would hang on it rather than fail
        raise ConfigError(f"cluster.executor=slurm, but {unreachable_hint()}")
    try:
        out = subprocess.run(
            ["scontrol", "show", kind, "-o"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"`scontrol show {kind}` hung for 30 s: {_NO_CLUSTER_FIX}") from None
    if out.returncode != 0:
        why = "; ".join(out.stderr.split("\n")).strip("; ") or f"exit status {out.returncode}"
        raise ConfigError(
            f"cluster.executor=slurm, but Slurm is not reachable (`scontrol show {kind}`: "
            f"{why}): {unreachable_hint()}"
        )
    return [parse_pairs(line) for line in out.stdout.splitlines() if "=" in line]


def unreachable_hint(env: Mapping[str, str] | None = None) -> str:
    """What to do when the Slurm client tools cannot reach a controller, from SLURM_CONF."""
    env = os.environ if env is None else env
    dev_env = 'eval "$(cluster/dev/slurm.sh env)"'
    conf = env.get("SLURM_CONF")
    if not conf:
        where = (
            f"the dev cluster's is {slurm_conf()}: run {dev_env} in this shell"
            if slurm_conf().exists()
            else "start a dev cluster with `trainflow cluster up`, then run " + dev_env
        )
        return (
            "SLURM_CONF is not set, so Slurm looked for /etc/slurm/slurm.conf and then for DNS "
            f"SRV records; point SLURM_CONF at your cluster's slurm.conf ({where}), {_LOCAL}"
        )
    if not Path(conf).is_file():
        return f"SLURM_CONF={conf} does not exist: run {dev_env} or fix the path, {_LOCAL}"
    return (
        f"check that SLURM_CONF={conf} is your cluster's slurm.conf and that its slurmctld "
        f"runs (the dev cluster: `trainflow cluster status`, `trainflow cluster up`), {_LOCAL}"
    )


def parse_pairs(line: str) -> dict[str, str]:
    """`A=1 B=x y C=` -> {"A": "1", "B": "x y", "C": ""}."""
    matches = list(_PAIR.finditer(line))
    ends = [m.start() for m in matches[1:]] + [len(line)]
    return {m.group(1): line[m.end() : end].strip() for m, end in zip(matches, ends, strict=True)}


def _limit(value: str) -> int | None:
    return None if value.upper() in _UNLIMITED else int(value)


def _partition(rec: dict[str, str]) -> Partition:
    return Partition(
        name=rec["PartitionName"],
        default=rec.get("Default") == "YES",
        total_nodes=int(rec.get("TotalNodes", "0")),
        max_nodes=_limit(rec.get("MaxNodes", "UNLIMITED")),
        max_time_min=time_to_minutes(rec.get("MaxTime", "UNLIMITED")),
        max_cpus_per_node=_limit(rec.get("MaxCPUsPerNode", "UNLIMITED")),
        max_mem_per_node_mb=_limit(rec.get("MaxMemPerNode", "UNLIMITED")),
    )


def _node(rec: dict[str, str]) -> Node:
    tres = dict(p.split("=", 1) for p in rec.get("CfgTRES", "").split(",") if "=" in p)
    # CPUEfctv (21.08+) leaves out cores reserved for the system; older versions lack it.
    cpus = rec.get("CPUEfctv") or rec.get("CPUTot", "0")
    return Node(
        name=rec["NodeName"],
        cpus=int(cpus),
        mem_mb=int(rec.get("RealMemory", "0")),
        gpus=int(tres.get("gres/gpu", "0")),
        partitions=tuple(p for p in rec.get("Partitions", "").split(",") if p),
    )


def time_to_minutes(value: str) -> int | None:
    """A Slurm time limit in whole minutes (seconds dropped); None: unlimited.

    Forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]].
    """
    if value.upper() in _UNLIMITED:
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        h, m = [*parts, 0, 0][:2]
    elif len(parts) == 3:
        h, m = parts[:2]
    else:
        h, m = 0, parts[0]
    return int(days or 0) * 1440 + h * 60 + m


def _pick_partition(cfg: ClusterConfig, partitions: list[Partition]) -> Partition:
    names = ", ".join(p.name for p in partitions) or "(none)"
    if cfg.partition is None:
        default = next((p for p in partitions if p.default), None)
        if default is None:
            raise ConfigError(
                f"cluster.partition is not set and the cluster has no default partition: "
                f"set cluster.partition to one of: {names}"
            )
        return default
    for part in partitions:
        if part.name == cfg.partition:
            return part
    raise ConfigError(
        f"cluster.partition={cfg.partition!r}: no such partition on this cluster; "
        f"set cluster.partition to one of: {names}"
    )


def _check_nodes(cfg: ClusterConfig, part: Partition) -> None:
    most = min(part.total_nodes, part.max_nodes or part.total_nodes)
    if cfg.nodes > most:
        raise ConfigError(
            f"cluster.nodes={cfg.nodes}, but partition {part.name!r} lets a job have at most "
            f"{most} node(s): set cluster.nodes<={most} or choose a larger cluster.partition"
        )


def _check_time(cfg: ClusterConfig, part: Partition) -> None:
    if part.max_time_min is not None and cfg.timeout_min > part.max_time_min:
        raise ConfigError(
            f"cluster.timeout_min={cfg.timeout_min}, but partition {part.name!r} has MaxTime "
            f"{part.max_time_min} min: set cluster.timeout_min<={part.max_time_min} (a "
            "checkpointed job is requeued and resumes, see cluster.max_requeues) or choose "
            "another cluster.partition"
        )


def _check_node_resources(cfg: ClusterConfig, part: Partition, nodes: list[Node]) -> None:
    """Each resource on its own first (the clearest message), then all at once on enough nodes."""
    where = f"the largest node of partition {part.name!r}"
    cpus = cfg.ranks_per_node * cfg.cpus_per_task
    max_cpus = _cap(max((n.cpus for n in nodes), default=0), part.max_cpus_per_node)
    _check_cpus(cfg, cpus, max_cpus, where)
    # Rounded up as cluster.executor rounds the --mem it sends.
    mem_mb = 0 if cfg.mem_gb is None else math.ceil(cfg.mem_gb * 1024)
    max_mem = _cap(max((n.mem_mb for n in nodes), default=0), part.max_mem_per_node_mb)
    _check_mem(cfg, mem_mb, max_mem, where)
    _check_gpus(cfg, max((n.gpus for n in nodes), default=0), where)
    fitting = [n for n in nodes if _fits(n, cpus, mem_mb, cfg.gpus_per_node)]
    if len(fitting) < cfg.nodes:
        raise ConfigError(
            f"cluster.nodes={cfg.nodes}: only {len(fitting)} node(s) of partition "
            f"{part.name!r} offer {cpus} CPUs, {cfg.gpus_per_node} GPU(s) and {mem_mb} MiB "
            "at once: lower cluster.nodes or the per-node request"
        )


def _check_cpus(cfg: ClusterConfig, cpus: int, max_cpus: int, where: str) -> None:
    if cpus > max_cpus:
        raise ConfigError(
            f"cluster.cpus_per_task={cfg.cpus_per_task} with cluster.ranks_per_node="
            f"{cfg.ranks_per_node} asks for {cpus} CPUs per node, but {where} offers "
            f"{max_cpus}: lower cluster.cpus_per_task or cluster.ranks_per_node so that their "
            f"product is <= {max_cpus}, or choose another cluster.partition"
        )


def _check_mem(cfg: ClusterConfig, mem_mb: int, max_mem: int, where: str) -> None:
    if mem_mb > max_mem:
        raise ConfigError(
            f"cluster.mem_gb={cfg.mem_gb} ({mem_mb} MiB per node), but {where} offers "
            f"{max_mem} MiB: set cluster.mem_gb<={math.floor(max_mem / 1024 * 100) / 100:g}, "
            "leave it unset for the partition's default, or choose another cluster.partition"
        )


def _check_gpus(cfg: ClusterConfig, max_gpus: int, where: str) -> None:
    if cfg.gpus_per_node > max_gpus:
        raise ConfigError(
            f"cluster.gpus_per_node={cfg.gpus_per_node}, but {where} has {max_gpus} GPU(s): "
            f"set cluster.gpus_per_node (and cluster.ranks_per_node) <= {max_gpus}, 0 for CPU "
            "training, or choose a GPU cluster.partition"
        )


def _cap(value: int, limit: int | None) -> int:
    return value if limit is None else min(value, limit)


def _fits(node: Node, cpus: int, mem_mb: int, gpus: int) -> bool:
    return node.cpus >= cpus and node.mem_mb >= mem_mb and node.gpus >= gpus


def check_cluster(cfg: ClusterConfig) -> None:
    """check_request for the Slurm executor; for allocation, that this process runs in a Slurm
    job with the nodes asked for; nothing to check for local or debug."""
    if cfg.executor == "slurm":
        try:
            check_image(cfg.container)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        check_request(cfg)
    if cfg.executor == "allocation":
        from trainflow.cluster.srun_executor import check_allocation

        check_allocation(cfg)
