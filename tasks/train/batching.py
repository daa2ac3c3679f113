"""The global batch a config asks for, as micro-batches of train.batch_size per rank.

An optimizer step takes `data ranks` micro-batches of train.batch_size, all ranks together: as
many as the ranks without gradient accumulation; train.global_batch_size / batch_size when
that is set; ranks x train.grad_accumulation when that is. Each rank accumulates data ranks /
ranks of them per step (tasks.train.loop). The data order is laid out for the data ranks
(tasks.train.data.accumulated_batches), and a checkpoint records their number, so a run
resumed on fewer ranks takes the same samples in every step (tasks.train.resume).

No torch here: the config's validation and the preflight (which knows the world size from
cluster.nodes x cluster.ranks_per_node) use it before anything imports torch.
"""

from typing import Protocol

from trainflow.errors import ConfigError


class BatchKeys(Protocol):
    """The keys of TrainConfig that make up the global batch (TrainConfig validates with this
    module, so it is not imported here)."""

    @property
    def batch_size(self) -> int:
        """train.batch_size."""
        ...

    @property
    def global_batch_size(self) -> int | None:
        """train.global_batch_size."""
        ...

    @property
    def grad_accumulation(self) -> int | None:
        """train.grad_accumulation."""
        ...


def check_batch_keys(global_batch: int | None, accumulation: int | None, batch_size: int) -> None:
    """ValueError (one line, the config's validation) when train.global_batch_size and
    train.grad_accumulation are both set, or the global batch is no whole number of
    micro-batches."""
    if global_batch is not None and accumulation is not None:
        raise ValueError(
            f"train.global_batch_size={global_batch} and train.grad_accumulation={accumulation} "
            "both set the gradient accumulation: set one of them (the accumulation follows "
            "from the global batch and the ranks)"
        )
    if global_batch is not None and global_batch % batch_size:
        raise ValueError(
            f"train.global_batch_size={global_batch} is not a whole number of micro-batches of "
            f"train.batch_size={batch_size}: {_fixes(global_batch, batch_size, 1)}"
        )


def data_ranks(cfg: BatchKeys, world: int) -> int:
    """Micro-batches per optimizer step, all `world` ranks together, of a run that starts on
    `world` ranks; ConfigError (one line naming the keys and values that would work) when
    train.global_batch_size is no multiple of train.batch_size x `world`."""
    if cfg.grad_accumulation is not None:
        return world * cfg.grad_accumulation
    if cfg.global_batch_size is None:
        return world
    if cfg.global_batch_size % (cfg.batch_size * world):
        raise ConfigError(
            f"train.global_batch_size={cfg.global_batch_size} is not a whole number of "
            f"micro-batches of train.batch_size={cfg.batch_size} on each of {world} ranks "
            f"(cluster.nodes x cluster.ranks_per_node): "
            f"{_fixes(cfg.global_batch_size, cfg.batch_size, world)}"
        )
    return cfg.global_batch_size // cfg.batch_size


def _fixes(global_batch: int, batch_size: int, world: int) -> str:
    """The nearest values of train.global_batch_size, and of train.batch_size, that divide."""
    unit = batch_size * world
    below, above = global_batch // unit * unit, (global_batch // unit + 1) * unit
    sizes = " or ".join(str(g) for g in (below, above) if g > 0)
    fix = f"set train.global_batch_size={sizes}"
    if global_batch % world == 0:
        per_rank = global_batch // world
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        nearest = sorted(sorted(divisors, key=lambda d: abs(d - batch_size))[:2])
        fix += f", or train.batch_size={' or '.join(str(d) for d in nearest)}"
    if world > 1 and global_batch % batch_size == 0:
        steps = global_batch // batch_size  # micro-batches per step: any divisor as ranks
        ranks = sorted(r for r in range(1, steps + 1) if steps % r == 0)
        nearest = sorted(sorted(ranks, key=lambda r: abs(r - world))[:2])
        fix += f", or train on {' or '.join(str(r) for r in nearest)} ranks"
    return fix
