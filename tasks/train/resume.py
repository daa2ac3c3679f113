"""Resuming a run from its newest checkpoint, with the global batch it started with.

A run's global batch (samples per optimizer step, all ranks together) is `data_world`
micro-batches of train.batch_size: the ranks it started on, times the gradient accumulation
train.global_batch_size or train.grad_accumulation asks for (tasks.train.batching). Its
learning rate and schedule were chosen for that batch, and its checkpoints record data_world
(Progress.data_world). A job on W ranks, where W divides data_world (a fresh start, a restart
on the nodes left after one was lost, train.strategy=fsdp; or a resubmission on fewer ranks),
keeps the global batch by gradient accumulation, as torchtitan does: each rank runs
k = data_world / W micro-batches of batch_size per optimizer step, each loss divided by k, and
steps once. Rank r takes the batches the data ranks r*k ... r*k+k-1 would have taken
(tasks.train.data.rank_batches over data_world "data ranks"), so every optimizer step sees the
samples the uninterrupted run's step saw, the epoch has as many steps, and the schedule is
unchanged. A W that does not divide data_world (more ranks, or 3 of 4) is refused in one line
before training.
"""

from dataclasses import dataclass
from typing import Any

from trainflow.console import say
from trainflow.errors import ConfigError
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import log_run_params
from trainflow.tasks.train.batching import data_ranks
from trainflow.tasks.train.checkpointing.checkpoint import Resumable, restore_rng, unwrap
from trainflow.tasks.train.checkpointing.sharded_checkpoint import load_sharded
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.progress import Progress, check_same_run


@dataclass(frozen=True)
class GlobalBatch:
    """How this job's ranks make up the run's global batch."""

    batch_size: int
    """Samples per micro-batch (train.batch_size)."""
    data_world: int
    """Ranks the run's data order is laid out for: the world size it started on."""
    world: int
    """This job's ranks."""
    planned: int = 1
    """The accumulation the config asks for on this job's ranks (a fresh start's): a
    different `accumulation` keeps a global batch the run started with on other ranks."""
    configured: bool = False
    """train.global_batch_size or train.grad_accumulation is set (data_world is then not the
    number of ranks the run started on)."""

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank and optimizer step: data_world / world."""
        return self.data_world // self.world

    @property
    def size(self) -> int:
        """Samples per optimizer step, all ranks together."""
        return self.batch_size * self.data_world


def global_batch(found: Resumable | None, cfg: TrainConfig, dist: DistContext) -> GlobalBatch:
    """The global batch of the run `found` continues (this job's own on a fresh start: the
    config's, tasks.train.batching). ConfigError when this job's ranks cannot make it up."""
    world = dist.dp_size  # data-parallel ranks: a tensor-parallel group takes one batch
    if found is None:
        data_world = data_ranks(cfg, world)
    else:  # 0: written before it was recorded (ran on this world)
        data_world = int(found.state.get("data_world", 0)) or world
    if data_world % world:
        assert found is not None
        raise ConfigError(
            f"{found.path} continues a run whose global batch is {cfg.batch_size * data_world} "
            f"(train.batch_size={cfg.batch_size} x {data_world} micro-batches), which {world} "
            f"ranks cannot make up by gradient accumulation ({world} does not divide "
            f"{data_world}): resume on {_divisors(data_world)} ranks"
        )
    configured = cfg.global_batch_size is not None or cfg.grad_accumulation is not None
    planned = data_ranks(cfg, world) // world  # divides: data_world does (one global batch)
    return GlobalBatch(cfg.batch_size, data_world, world, planned, configured)


def _divisors(n: int) -> str:
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def announce_global_batch(batch: GlobalBatch, epoch: int, journal: Journal | None) -> None:
    """Rank 0: say how the global batch is made up (a line, and the run's params): always
    `global_batch`, and `grad_accumulation.used` where the config's accumulation holds (the
    config's key `grad_accumulation` is a param of the run already); a line when ranks
    accumulate from the start; after a change of world size which accumulation kept the
    global batch, under a key of its own per resume (MLflow keeps a param's first value)."""
    params = {"global_batch": str(batch.size)}
    line = (
        f"{batch.world} ranks x {batch.accumulation} micro-batches of {batch.batch_size} "
        f"per step (gradient accumulation)"
    )
    if batch.accumulation != batch.planned:
        started = (
            f"the run takes {batch.data_world} micro-batches per step"
            if batch.configured
            else f"the run started on {batch.data_world} ranks"
        )
        say(
            f"global batch {batch.size} kept: {started} and continues after epoch {epoch} on {line}"
        )
        params[f"global_batch.after_epoch_{epoch}"] = line
    else:
        params["grad_accumulation.used"] = str(batch.accumulation)
        if batch.accumulation > 1 and epoch == 0:
            say(f"global batch {batch.size}: {line}")
    log_run_params(journal, params)


def restore(
    trainer: Trainer,
    found: Resumable,
    identity: dict[str, Any],
    steps_per_epoch: int,
    sharded: bool,
) -> Progress:
    """Load `found` into `trainer` (resharded onto this job's ranks under fsdp, however many
    wrote it) and return the run's progress; ConfigError when it belongs to another run
    (`identity`: this job's run_identity)."""
    path, state = found.path, found.state
    for line in found.skipped if trainer.dist.is_main else []:
        say(f"warning: skipping checkpoint {line}")
    check_same_run(identity, state.get("run", {}), path)
    if sharded:
        load_sharded(trainer.model, trainer.optimizer, path)
    else:
        unwrap(trainer.model).load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"])
    progress = Progress.from_state(state)
    # steps of the run's own layout (the global batch is kept: tasks.train.resume docstring)
    progress.step = progress.epoch * steps_per_epoch + progress.epoch_batches
    if trainer.dist.is_main:
        within = f", step {progress.step}" if progress.epoch_batches else ""
        say(f"resuming from {path} after epoch {progress.epoch}{within}")
    return progress
