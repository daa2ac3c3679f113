"""What an epoch leaves behind: the logged metrics, the best model, the checkpoint, the line.

The training job (tasks.train.job) calls these at every epoch's end; rank 0's writes run on
the recorder's thread while the next epoch trains (tasks.train.recorder).
"""

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from trainflow.tasks.tracking.logger import MetricLogger
from trainflow.tasks.train.checkpoint import (
    Retain,
    host_copy,
    rng_state,
    save_best_weights,
    save_checkpoint,
    training_state,
)
from trainflow.tasks.train.job_spec import TrainJobSpec
from trainflow.tasks.train.log_lines import progress_line
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.progress import Progress, best_meta
from trainflow.tasks.train.recorder import EpochRecorder
from trainflow.tasks.train.sharded_checkpoint import ShardedSaver, full_weights
from trainflow.tasks.train.time_limit import Estimates


class EpochJob(Protocol):
    """What this module needs of the training job (tasks.train.job.TrainingJob)."""

    spec: TrainJobSpec
    attempt: int
    stalled: int
    saved_step: int
    keep: Retain

    @property
    def checkpoint_dir(self) -> Path: ...

    def _run_identity(self) -> dict[str, Any]: ...

    def _decide(
        self, trainer: Trainer, progress: Progress, metrics: dict[str, float]
    ) -> tuple[bool, dict[str, Any] | None]: ...


def decide(
    job: EpochJob, trainer: Trainer, progress: Progress, metrics: dict[str, float]
) -> tuple[bool, dict[str, Any] | None]:
    """(whether this epoch flushes the logger, best.pt's meta when this epoch is the best
    so far by the monitor, else None); updates `progress.logged_epochs` accordingly."""
    cfg, epoch = job.spec.train, progress.epoch
    flush = epoch % cfg.log_every_epochs == 0 or epoch == cfg.epochs
    if flush:
        progress.logged_epochs = epoch
    if progress.best_epoch == epoch:  # the monitor's choice (TrainingJob._observe)
        return flush, best_meta(job.spec.train, job.spec.dataset, progress)
    return flush, None


def record(
    job: EpochJob,
    trainer: Trainer,
    progress: Progress,
    metrics: dict[str, float],
    logger: MetricLogger,
    recorder: EpochRecorder,
    estimates: Estimates,
) -> None:
    """Rank 0's side effects of an epoch: log, best model, checkpoint, progress line.

    Decided and snapshotted here, written by the recorder's thread while the next epoch
    trains. The checkpoint's write is timed into `estimates` (the time-limit watch's).
    """
    cfg, epoch = job.spec.train, progress.epoch
    flush, best = job._decide(trainer, progress, metrics)  # a test may override it
    progress.timing = estimates.as_state()
    extra = {**asdict(progress), "run": job._run_identity()}
    state = host_copy(training_state(trainer.model, trainer.optimizer, trainer.scaler, extra))

    def write() -> None:
        logger.log(metrics, step=epoch)
        if flush:
            logger.flush()
        if best is not None:
            save_best_weights(state["model"], job.spec.out_dir / "best.pt", best)
        started = time.monotonic()
        save_checkpoint(state, job.checkpoint_dir, job.keep)
        estimates.save_s = time.monotonic() - started
        job.saved_step = int(state["step"])
        print(f"epoch {epoch}/{cfg.epochs} {progress_line(metrics)}", flush=True)

    recorder.submit(write)


def record_sharded(
    job: EpochJob,
    trainer: Trainer,
    progress: Progress,
    metrics: dict[str, float],
    logger: MetricLogger,
    recorder: EpochRecorder,
    saver: ShardedSaver,
    estimates: Estimates,
) -> None:
    """An fsdp epoch's side effects, on every rank (the validation metrics, hence the
    decisions, are the same on all): the best weights gathered whole into rank 0's best.pt,
    the sharded checkpoint started by all ranks (written while the next epoch trains, one
    in flight: ShardedSaver, which times it into `estimates`), then rank 0 logs and prints
    through the recorder."""
    cfg, epoch, ctx = job.spec.train, progress.epoch, trainer.dist
    flush, best = job._decide(trainer, progress, metrics)  # a test may override it
    if best is not None:
        weights = full_weights(trainer.model)  # collective
        if ctx.is_main:
            save_best_weights(weights, job.spec.out_dir / "best.pt", best)
    progress.timing = estimates.as_state()
    extra = {**asdict(progress), "run": job._run_identity()}
    train_state = {"scaler": trainer.scaler.state_dict(), "rng": rng_state(), **extra}
    saver.save(trainer.model, trainer.optimizer, train_state, job.checkpoint_dir, epoch)
    job.saved_step = progress.step
    if not ctx.is_main:
        return

    def write() -> None:
        logger.log(metrics, step=epoch)
        if flush:
            logger.flush()
        print(f"epoch {epoch}/{cfg.epochs} {progress_line(metrics)}", flush=True)

    recorder.submit(write)
