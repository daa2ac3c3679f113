"""The training job's side of a time limit: checkpoint where the watch stops, requeue, and
count the attempts that reached their limit without progress.

tasks.train.limits.time_limit decides where to stop; this saves the state there (mid-epoch if need
be: the position, the epoch's metric sums so far and the RNG state go with it; rank 0 writes a
ddp run's whole state, every rank its shards of an fsdp run's, through the run's ShardedSaver),
says so in one line, and requeues through submitit (rank 0 signals itself, so submitit calls
the job's `checkpoint`). That method asks `count_stalled` how many attempts in a row have now
ended at a time limit without a new checkpoint: past `cluster.max_requeues` the job fails with
StalledAtTimeLimit. Requeues that made progress never count, so a job runs to its end across as
many time limits as it needs. A single job and a sweep's element are TrainingJobs; a search's
array task counts through the trial it trains (tasks.search.trial_worker): one rule for all.
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from trainflow.console import say
from trainflow.tasks.train.checkpointing.checkpoint import (
    Retain,
    newest_kept,
    rng_state,
    save_checkpoint,
    training_state,
)
from trainflow.tasks.train.checkpointing.recorder import EpochRecorder
from trainflow.tasks.train.checkpointing.sharded_checkpoint import ShardedSaver
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job_spec import TrainJobSpec
from trainflow.tasks.train.limits.time_limit import (
    SAVE_FACTOR,
    EpochLimit,
    Estimates,
    TimeLimit,
    requeue_now,
    time_text,
)
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.progress import Progress, run_identity


class RequeuedJob(Protocol):
    """What the requeue count needs of a training job (tasks.train.job.TrainingJob)."""

    spec: TrainJobSpec
    attempt: int
    stalled: int
    requeue: "LimitRequeue | None"
    """The running attempt's watch (None before it starts)."""

    @property
    def saved_step(self) -> int: ...


NEAR_LIMIT_S = 60.0
"""A requeue signal this close to the point where the job must have checkpointed (or later)
is the time limit's; earlier, it is a preemption, which never counts as an attempt without
progress (Slurm checks limits about every 30 s, so its signal comes up to that late)."""


class StoppedForTimeLimit(Exception):
    """An epoch stopped early at the time-limit watch's step (the job saves and requeues)."""


class StalledAtTimeLimit(Exception):
    """Attempts in a row reached their time limit without a new checkpoint."""

    def __init__(self, stalled: int, max_requeues: int, step: int) -> None:
        where = f"step {step}" if step >= 0 else "the start (no checkpoint yet)"
        super().__init__(
            f"{stalled} attempts in a row reached their time limit without a new checkpoint "
            f"(still at {where}; cluster.max_requeues={max_requeues}): not requeued again. "
            "Start-up, a few steps and one checkpoint save must fit in cluster.timeout_min "
            "less train.time_limit_margin_s: raise cluster.timeout_min or lower the margin"
        )


@dataclass
class LimitRequeue:
    """One attempt's time-limit watch, where the attempt started and its newest checkpoint."""

    limit: TimeLimit
    identity: dict[str, Any]
    """The run's identity (tasks.train.progress.run_identity), written into its checkpoint."""
    checkpoint_dir: Path
    attempt: int = 1
    start_step: int = -1
    """The step the attempt started training at (-1 while it starts)."""
    saved_step: int = -1
    """The step of the newest checkpoint this attempt wrote or resumed from (-1: none)."""
    keep: Retain = newest_kept
    """Which checkpoints a save keeps (train.keep_checkpoints: the monitor's)."""

    @classmethod
    def for_job(cls, spec: TrainJobSpec, attempt: int, ctx: DistContext) -> "LimitRequeue":
        """The watch of attempt `attempt` of the job of `spec`, from its start."""
        limit = TimeLimit.for_job(ctx, spec.signal_delay_s, spec.train.time_limit_margin_s)
        identity = run_identity(spec.train, spec.dataset.content_hash)
        return cls(limit, identity, spec.checkpoint_dir, attempt)

    def save_took(self, seconds: float) -> None:
        """A checkpoint save took `seconds` (rank 0): what the next plans count on."""
        self.limit.estimates.save_s = seconds

    def resumed(self, progress: Progress, checkpointed: bool) -> None:
        """The attempt starts training at `progress` (`checkpointed`: resumed from a
        checkpoint there): the measurements of the attempts before, and a line from the second
        attempt on."""
        self.start_step = progress.step
        self.saved_step = progress.step if checkpointed else -1
        self.limit.estimates = Estimates.from_state(progress.timing)
        if self.limit.ctx.is_main and self.attempt > 1:
            within = f", batch {progress.epoch_batches}" if progress.epoch_batches else ""
            say(
                f"attempt {self.attempt} continues from step {progress.step} "
                f"(epoch {progress.epoch + 1}{within})"
            )

    def epoch(self, progress: Progress, until: int) -> EpochLimit:
        """The loop's stop for a segment of an epoch from `progress.step` on, where the next
        validation, checkpoint or epoch end comes at step `until` (RunPlan.next_pause)."""
        self.limit.start_epoch(progress.step, until - progress.step)
        return EpochLimit(self.limit, list(progress.epoch_sums))

    def checkpoint_and_requeue(
        self,
        trainer: Trainer,
        progress: Progress,
        recorder: EpochRecorder,
        saver: ShardedSaver | None = None,
    ) -> NoReturn:
        """Save the state at this step boundary (nothing when the newest checkpoint is of this
        step), then requeue. Every rank calls it; rank 0 writes a ddp run's checkpoint, every
        rank its shards through `saver` (an fsdp run's). Never returns: the attempt ends here."""
        main = trainer.dist.is_main
        if main:
            recorder.wait()  # the last epoch's checkpoint is on disk first (ddp)
        if saver is not None:
            saver.wait()  # the last epoch's checkpoint is in place first (fsdp)
        left = time_text(self.limit.until_limit_s() or 0.0)
        if progress.step in (self.saved_step, self.start_step):  # nothing new to save
            if main:
                say(f"time limit in {left}: no step done since step {progress.step}, requeueing")
            requeue_now(main)
        est = self.limit.estimates
        if main:
            say(
                f"time limit in {left}: checkpointing at step {progress.step} (save takes "
                f"~{est.save_s * SAVE_FACTOR:.0f} s), requeueing"
            )
        progress.timing = est.as_state()
        extra = {**asdict(progress), "run": self.identity}
        if saver is not None:
            state = {"scaler": trainer.scaler.state_dict(), "rng": rng_state(), **extra}
            saver.save(
                trainer.model,
                trainer.optimizer,
                state,
                self.checkpoint_dir,
                progress.epoch,
                progress.epoch_batches,
            )
            saver.wait()  # in place on every rank before rank 0 requeues
        elif main:
            state = training_state(trainer.model, trainer.optimizer, trainer.scaler, extra)
            started = time.monotonic()
            save_checkpoint(state, self.checkpoint_dir, self.keep)
            self.save_took(time.monotonic() - started)
        self.saved_step = progress.step
        requeue_now(main)

    @property
    def made_progress(self) -> bool:
        """Whether this attempt wrote a checkpoint newer than the one it started from."""
        return self.saved_step > self.start_step

    def stalled_after(self, stalled: int) -> int:
        """Attempts in a row, this one included, that ended at their time limit without a new
        checkpoint, when `stalled` did before it (for rank 0's `checkpoint`, at the requeue
        signal)."""
        if self.made_progress:
            return 0
        remaining = self.limit.remaining_s()
        if remaining is not None and remaining > NEAR_LIMIT_S:
            return stalled  # a preemption: neither progress nor a stall
        return stalled + 1


def made_progress(job: RequeuedJob) -> bool:
    """Whether this attempt of `job` wrote a checkpoint newer than the one it started from."""
    return job.requeue is not None and job.requeue.made_progress


def stalled_after(job: RequeuedJob) -> int:
    """Attempts in a row, this one included, that ended at their time limit without a new
    checkpoint; an attempt stopped before it started training counts as one."""
    requeue = job.requeue
    return requeue.stalled_after(job.stalled) if requeue is not None else job.stalled + 1


def check_stalled(stalled: int, max_requeues: int, step: int) -> int:
    """`stalled` (attempts in a row without progress, this one included), or
    StalledAtTimeLimit once past `max_requeues` (`step`: the newest checkpoint's, -1: none)."""
    if stalled > max_requeues:
        raise StalledAtTimeLimit(stalled, max_requeues, step)
    return stalled


def count_stalled(job: RequeuedJob) -> int:
    """At the requeue signal, in rank 0's `checkpoint`: the attempts in a row, this one
    included, that ended at their time limit without a new checkpoint; StalledAtTimeLimit once
    past the job's cluster.max_requeues."""
    return check_stalled(stalled_after(job), job.spec.max_requeues, job.saved_step)
