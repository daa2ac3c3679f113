"""Restarting a job that lost a rank: resubmit from its last checkpoint, away from a lost node.

torchrun's elastic `max_restarts`, for submitit jobs: when a job ends because a rank was lost
(cluster.lost_ranks.RankLostError: killed, or its node gone), it is submitted again up to
`cluster.max_restarts` times. The training job resumes from its newest checkpoint by itself and
logs into the same MLflow run (the spec is unchanged). On Slurm the new job excludes the nodes
that lost ranks when the partition's other nodes can still hold it. A rank that raised is a bug,
not a loss: it is never restarted.
"""

from collections.abc import Callable
from typing import Any

import submitit

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.lost_ranks import RankLostError

Submit = Callable[[list[str], int], submitit.Job[Any]]
"""Submits the job on the given number of nodes, excluding the given nodes, and returns it."""


def can_exclude(cfg: ClusterConfig, excluded: set[str]) -> bool:
    """Whether a Slurm job of cfg still fits on its partition's usable nodes without `excluded`
    (for executor=allocation: on the nodes of the Slurm job the flow runs in)."""
    if cfg.executor not in ("slurm", "allocation") or not excluded:
        return False
    if cfg.executor == "allocation":
        from trainflow.cluster.srun_executor import allocation_nodes

        return len(set(allocation_nodes()) - excluded) >= cfg.nodes
    from trainflow.cluster.slurm_checks import read_nodes, read_partitions

    parts = read_partitions()
    part = next(p for p in parts if p.name == cfg.partition or (not cfg.partition and p.default))
    left = [n for n in read_nodes() if part.name in n.partitions and n.name not in excluded]
    return len(left) >= cfg.nodes


def run_with_restarts(
    cfg: ClusterConfig,
    submit: Submit,
    wait: Callable[[submitit.Job[Any]], Any],
    log: Callable[[str], None],
    on_loss: Callable[[RankLostError, int], None] = lambda err, attempt: None,
    elastic: bool = False,
) -> Any:
    """Submit and wait; after a lost rank, submit again (at most cfg.max_restarts times).

    `on_loss(err, attempt)` is told of every loss (e.g. to tag the MLflow run). With no restart
    left the last RankLostError propagates, saying so. `elastic` (a job whose checkpoints load
    on any number of ranks: train.strategy=fsdp): when the other nodes cannot hold the job at
    its size, it continues on the nodes left, without the lost ones.
    """
    excluded: set[str] = set()
    nodes = cfg.nodes
    for attempt in range(cfg.max_restarts + 1):
        job = submit(sorted(excluded), nodes)
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
            lost_nodes = set(err.nodes)
            fewer = nodes - len(lost_nodes - excluded)
            if can_exclude(cfg.model_copy(update={"nodes": nodes}), excluded | lost_nodes):
                excluded |= lost_nodes
                where = f"excluding node(s) {', '.join(sorted(excluded))}"
            elif (
                elastic
                and fewer >= 1
                and can_exclude(cfg.model_copy(update={"nodes": fewer}), excluded | lost_nodes)
            ):
                excluded |= lost_nodes
                nodes = fewer
                where = (
                    f"excluding node(s) {', '.join(sorted(excluded))}, on the {fewer} node(s) "
                    f"left ({fewer * cfg.ranks_per_node} ranks: the sharded checkpoint reshards)"
                )
            else:
                where = "on any node (the others cannot hold the job alone)"
            log(
                f"{headline}: restart {attempt + 1}/{cfg.max_restarts} from the last checkpoint, "
                f"{where}"
            )
    raise AssertionError("unreachable")
