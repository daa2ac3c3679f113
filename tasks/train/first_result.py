"""The run's first result: the test split through the best weights, in the job, as training ends.

The evaluate stage (tasks.evaluate) reports the test split with plots, the model's export and
its registration; it starts only once the job has ended and its task has handed over. The job
itself holds the model, its ranks and the objective's streamed metrics already: a test pass
here is a validation pass over the test split, each rank taking a share (one all_reduce), so
the headline test metric is on the console and the train run as soon as the last epoch's
record is written, as Lightning users get it from `trainer.test()` after `fit`.

The weights are the best epoch's (the evaluate stage's): the live model when the last epoch is
the best, else best.pt loaded into it (every rank reads the file; a sharded model takes it from
rank 0, as shard_from_rank0 fills it). The pass runs in fp32, as the evaluate stage does, so the
two agree; a compiled model keeps the training precision (another would recompile it).
`train.test_after_training=false` turns it off (the test split is then read only by evaluate).
"""

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainflow.console import say
from trainflow.tasks.tracking.logger import MetricLogger
from trainflow.tasks.train.checkpointing.checkpoint import load_state, unwrap
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import load_split_to
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.loop import Trainer, evaluate_split
from trainflow.tasks.train.precision import PrecisionPolicy
from trainflow.tasks.train.progress import Progress
from trainflow.tasks.train.sharded_init import fill_from_rank0
from trainflow.tasks.train.sharding import is_sharded


def first_result(
    trainer: Trainer,
    cfg: TrainConfig,
    dataset_path: Path,
    out_dir: Path,
    progress: Progress,
    channels_last: bool,
    logger: MetricLogger,
) -> dict[str, float]:
    """The best weights' test metrics (collective: every rank calls it once the last epoch's
    record is written); rank 0 prints them in one line and logs them to the train run at the
    best epoch's step. {} when off, untrained, or the test split is empty."""
    if not cfg.test_after_training:
        return {}
    ctx = trainer.dist
    best_epoch = rank0_best_epoch(progress.best_epoch, ctx)
    if best_epoch == 0:
        return {}
    test = load_split_to(dataset_path, "test", ctx.device, channels_last, cfg.data_placement)
    if len(test) == 0:
        return {}
    if best_epoch != progress.epoch:
        load_best(trainer.model, out_dir / "best.pt", ctx)
    policy = trainer.policy if cfg.compile or trainer.cuda_graphs else fp32(trainer.policy)
    metrics = evaluate_split(
        trainer.model,
        test,
        4 * cfg.batch_size,
        policy,
        ctx,
        trainer.objective,
        trainer.cuda_graphs,
        trainer.heartbeat,
        trainer.pipeline,
    )
    tested = {f"test_{k}": v for k, v in metrics.items()}
    if ctx.is_main:
        headline = trainer.objective.headline
        say(result_line(tested, headline, best_epoch, len(test)))
        logger.log(tested, step=best_epoch)
        logger.flush()
    return tested


def rank0_best_epoch(best_epoch: int, ctx: DistContext) -> int:
    """Rank 0's best epoch on every rank (only rank 0 decides it under DDP; collective)."""
    if ctx.world_size == 1:
        return best_epoch
    value = torch.tensor([best_epoch], dtype=torch.int64, device=ctx.device)
    dist.broadcast(value, src=0)
    return int(value.item())


def fp32(policy: PrecisionPolicy) -> PrecisionPolicy:
    """No autocast on the policy's device."""
    return PrecisionPolicy(policy.device_type, None, False, "fp32", "the evaluate stage's")


def load_best(model: nn.Module, best: Path, ctx: DistContext) -> None:
    """best.pt's weights into `model`, DDP-wrapped or sharded (collective). Rank 0 wrote the
    file before this; a sharded model takes it from rank 0 alone."""
    if ctx.world_size > 1:
        dist.barrier()  # rank 0's record of the best epoch is on disk
    if not is_sharded(model) and ctx.pp == 1:  # a pipeline stage holds part of the file
        unwrap(model).load_state_dict(load_state(best)["model"])
        return
    full: dict[str, Any] = load_state(best)["model"] if ctx.is_main else {}
    fill_from_rank0(model, full, ctx)


def result_line(metrics: dict[str, float], headline: str, best_epoch: int, samples: int) -> str:
    """What rank 0 prints: `test accuracy 0.9660 (first result: ...)`."""
    key = f"test_{headline}"
    others = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != key)
    return (
        f"{key.replace('_', ' ')} {metrics[key]:.4f} (first result: epoch {best_epoch}'s best "
        f"weights on {samples:,} test samples{'; ' + others if others else ''}; the evaluate "
        "stage's report follows)"
    )
