"""Resuming a run from its newest checkpoint, and keeping its global batch when the number of
ranks changed.

`train.batch_size` is per rank: a run started on W ranks takes batch_size x W samples per
optimizer step, and its learning rate and schedule were chosen for that global batch. Its
checkpoints record W (Progress.data_world). A run that resumes on W' ranks where W' divides W
(a restart on the nodes left after one was lost, train.strategy=fsdp; or a resubmission on
fewer ranks) keeps the global batch by gradient accumulation, as torchtitan does: each rank
runs k = W / W' micro-batches of batch_size per optimizer step, each loss divided by k, and
steps once. Rank r takes the batches the original ranks r*k ... r*k+k-1 would have taken
(tasks.train.data.rank_batches over W "data ranks"), so every optimizer step sees the samples
the uninterrupted run's step saw, the epoch has as many steps, and the schedule is unchanged.
A W' that does not divide W (more ranks, or 3 of 4) is refused in one line before training.
"""

from dataclasses import dataclass
from typing import Any

from trainflow.errors import ConfigError
from trainflow.tasks.tracking.journal import Journal
from trainflow.tasks.tracking.logger import log_run_params
from trainflow.tasks.train.checkpointing.checkpoint import Resumable, restore_rng, unwrap
from trainflow.tasks.train.checkpointing.sharded_checkpoint import load_sharded
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

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank and optimizer step: data_world / world."""
        return self.data_world // self.world

    @property
    def size(self) -> int:
        """Samples per optimizer step, all ranks together."""
        return self.batch_size * self.data_world


def global_batch(found: Resumable | None, batch_size: int, dist: DistContext) -> GlobalBatch:
    """The global batch of the run `found` continues (this job's own on a fresh start).
    ConfigError when this job's ranks cannot make up the saved one."""
    world = dist.world_size
    saved = int(found.state.get("data_world", 0)) if found is not None else 0
    data_world = saved or world  # 0: written before it was recorded (ran on this world)
    if data_world % world:
        assert found is not None
        raise ConfigError(
            f"{found.path} continues a run whose global batch is {batch_size * data_world} "
            f"(train.batch_size={batch_size} x {data_world} ranks), which {world} ranks cannot "
            f"make up by gradient accumulation ({world} does not divide {data_world}): resume "
            f"on {_divisors(data_world)} ranks"
        )
    return GlobalBatch(batch_size, data_world, world)


def _divisors(n: int) -> str:
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def announce_global_batch(batch: GlobalBatch, epoch: int, journal: Journal | None) -> None:
    """Rank 0: say how the global batch is made up (a line, and the run's params): always
    `global_batch`; after a change of world size also which accumulation kept it, under a key
    of its own per resume (MLflow keeps a param's first value)."""
    params = {"global_batch": str(batch.size)}
    if batch.accumulation > 1:
        line = (
            f"{batch.world} ranks x {batch.accumulation} micro-batches of {batch.batch_size} "
            f"per step (gradient accumulation)"
        )
        print(
            f"global batch {batch.size} kept: the run started on {batch.data_world} ranks and "
            f"continues after epoch {epoch} on {line}",
            flush=True,
        )
        params[f"global_batch.after_epoch_{epoch}"] = line
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
        print(f"warning: skipping checkpoint {line}", flush=True)
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
        print(f"resuming from {path} after epoch {progress.epoch}{within}", flush=True)
    return progress
