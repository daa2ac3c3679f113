"""Restarting a job that lost a rank: resubmit from its last checkpoint, away from a lost node.

torchrun's elastic `max_restarts`, for submitit jobs: when a job ends because a rank was lost
(cluster.lost_ranks.RankLostError: killed, or its node gone), it is submitted again up to
`cluster.max_restarts` times. The training job resumes from its newest checkpoint by itself and
logs into the same MLflow run (the spec is unchanged). On Slurm the new job excludes the nodes
that lost ranks when the partition's other nodes can still hold it. A rank that raised is a bug,
not a loss: it is never restarted.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import submitit

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.lost_ranks import RankLostError

Submit = Callable[[list[str], int], submitit.Job[Any]]
"""Submits the job on the given number of nodes, excluding the given nodes, and returns it."""


def usable_nodes(cfg: ClusterConfig) -> list[str] | None:
    """The nodes a restarted job of cfg may run on: its partition's nodes (executor=slurm), or
    those of the Slurm job the flow runs in (executor=allocation); None where trainflow does not
    place jobs on nodes (the local and debug executors)."""
    if cfg.executor == "allocation":
        from trainflow.cluster.srun_executor import allocation_nodes

        return list(allocation_nodes())
    if cfg.executor != "slurm":
        return None
    from trainflow.cluster.slurm_checks import read_nodes, read_partitions

    parts = read_partitions()
    part = next(p for p in parts if p.name == cfg.partition or (not cfg.partition and p.default))
    return [n.name for n in read_nodes() if part.name in n.partitions]


def can_exclude(cfg: ClusterConfig, excluded: set[str]) -> bool:
    """Whether a Slurm job of cfg still fits on its partition's usable nodes without `excluded`
    (for executor=allocation: on the nodes of the Slurm job the flow runs in)."""
    if not excluded:
        return False
    usable = usable_nodes(cfg)
    return usable is not None and len(set(usable) - excluded) >= cfg.nodes


@dataclass(frozen=True)
class Placement:
    """Where the next attempt of a job that lost ranks runs."""

    nodes: int
    """How many nodes it asks for."""
    excluded: frozenset[str]
    """The nodes it must not run on."""
    where: str
    """Said in the restart's log line: 'excluding node(s) n2', 'on any node (...)'."""


def next_placement(
    nodes: int,
    ranks_per_node: int,
    excluded: frozenset[str],
    lost_nodes: set[str],
    usable: list[str] | None,
    elastic: bool | Callable[[int], bool],
    started_on: int | None = None,
) -> Placement:
    """The rule that places a restart (no Slurm involved: `usable` is what usable_nodes read).

    A job of `nodes` nodes that lost ranks on `lost_nodes` runs again at the same size away
    from every lost node when the `usable` nodes left can hold it; else, when `elastic` (its
    checkpoints reshard onto fewer ranks) and a node is left, on as many of the nodes left as
    divide `started_on` (the run's first size, default `nodes`: its global batch is then kept
    by gradient accumulation, tasks.train.resume); else anywhere, the lost nodes included (a
    node that lost a rank may well run the next attempt). `usable` None (no placement, a local
    executor): anywhere. `elastic` may be a predicate on a number of ranks instead: the sizes
    the job can run at (train.parallel's mesh must make them up)."""
    fits = elastic if callable(elastic) else (lambda ranks: elastic)
    without = excluded | lost_nodes
    left = len(set(usable) - without) if usable is not None and without else -1
    if left >= nodes:
        return Placement(nodes, without, f"excluding node(s) {', '.join(sorted(without))}")
    first = started_on or nodes
    most = min(nodes - len(lost_nodes - excluded), left)
    sizes = [d for d in range(1, most + 1) if first % d == 0]
    fewer = max((d for d in sizes if fits(d * ranks_per_node)), default=0)
    if fewer:
        where = (
            f"excluding node(s) {', '.join(sorted(without))}, on {fewer} of the {left} node(s) "
            f"left ({fewer * ranks_per_node} ranks: the sharded checkpoint reshards)"
        )
        return Placement(fewer, without, where)
    why = "the others cannot hold the job alone"
    if elastic and sizes and not fewer:
        why += f" and train.parallel makes up no fewer ranks than {nodes * ranks_per_node}"
    return Placement(nodes, excluded, f"on any node ({why})")


def run_with_restarts(
    cfg: ClusterConfig,
    submit: Submit,
    wait: Callable[[submitit.Job[Any]], Any],
    log: Callable[[str], None],
    on_loss: Callable[[RankLostError, int], None] = lambda err, attempt: None,
    elastic: bool | Callable[[int], bool] = False,
) -> Any:
    """Submit and wait; after a lost rank, submit again (at most cfg.max_restarts times).

    `on_loss(err, attempt)` is told of every loss (e.g. to tag the MLflow run). With no restart
    left the last RankLostError propagates, saying so. `elastic` (a job whose checkpoints load
    on any number of ranks: train.strategy=fsdp; or a predicate on the number of ranks, the
    sizes its mesh allows): when the other nodes cannot hold the job at its size, it continues
    on the nodes left, without the lost ones.
    """
    placement = Placement(cfg.nodes, frozenset(), "")
    for attempt in range(cfg.max_restarts + 1):
        job = submit(sorted(placement.excluded), placement.nodes)
        try:
            return wait(job)
        except RankLostError as err:
            on_loss(err, attempt)
            headline = str(err).splitlines()[0]
            if attempt == cfg.max_restarts:
                raise type(err)(
                    f"{err}; no restart left (cluster.max_restarts={cfg.max_restarts})",
                    err.lost,
                    err.nodes,
                    err.detail,
                ) from None
            usable = usable_nodes(cfg)
            placement = next_placement(
                placement.nodes,
                cfg.ranks_per_node,
                placement.excluded,
                set(err.nodes),
                usable,
                elastic,
                cfg.nodes,
            )
            log(
                f"{headline}: restart {attempt + 1}/{cfg.max_restarts} from the last checkpoint, "
                f"{placement.where}"
            )
    raise AssertionError("unreachable")
