"""What a boundary of the training leaves behind (an epoch's end, or a step of
train.val_every_steps / checkpoint_every_steps): the logged metrics, the best model, the
checkpoint, the line.

The training job (tasks.train.job) calls these at each boundary where a validation or a
checkpoint is due (tasks.train.cadence); rank 0's writes run on the recorder's thread while
training goes on (tasks.train.recorder).
"""

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from trainflow.tasks.objectives import is_better
from trainflow.tasks.tracking.logger import MetricLogger
from trainflow.tasks.train.cadence import EPOCH_END, Due
from trainflow.tasks.train.checkpoint import (
    host_copy,
    rng_state,
    save_best_weights,
    save_checkpoint,
    training_state,
    unwrap,
)
from trainflow.tasks.train.config import TrainConfig
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

    @property
    def checkpoint_dir(self) -> Path: ...

    def _run_identity(self) -> dict[str, Any]: ...

    def _decide(
        self, trainer: Trainer, progress: Progress, metrics: dict[str, float]
    ) -> tuple[bool, dict[str, Any] | None]: ...


def decide(
    job: EpochJob, trainer: Trainer, progress: Progress, metrics: dict[str, float]
) -> tuple[bool, dict[str, Any] | None]:
    """(whether this validation flushes the logger, best.pt's meta when it is the best so
    far, else None); updates `progress` accordingly. An epoch's end flushes every
    train.log_every_epochs epochs; a validation inside an epoch (train.val_every_steps) and the
    run's last always do."""
    cfg, epoch = job.spec.train, progress.epoch
    inside = progress.epoch_batches > 0  # validated inside an epoch
    last = progress.step >= trainer.total_steps
    flush = inside or last or epoch % cfg.log_every_epochs == 0
    if flush:
        progress.logged_epochs = len(progress.history)
    select = f"val_{trainer.objective.select}"
    value = metrics[select]
    if progress.best_epoch == 0 or is_better(
        trainer.objective, select, value, progress.best_metric
    ):
        progress.best_metric, progress.best_epoch = value, len(progress.history)
        return flush, best_meta(job.spec.train, job.spec.dataset, progress)
    return flush, None


def metric_x(train: TrainConfig, entry: dict[str, float]) -> int:
    """The x axis value of a history entry's metrics: its global step when the run counts in
    steps (train.counts_steps), else its epoch."""
    return int(entry["step"] if train.counts_steps else entry["epoch"])


def record(
    job: EpochJob,
    trainer: Trainer,
    progress: Progress,
    metrics: dict[str, float],
    logger: MetricLogger,
    recorder: EpochRecorder,
    estimates: Estimates,
    due: Due = EPOCH_END,
    line: str = "",
) -> None:
    """Rank 0's side effects of a boundary: with a validation (`due.validate`: `metrics` and
    progress.history[-1] hold it) the log, the best model and the progress `line`; with
    `due.checkpoint` the checkpoint.

    Decided and snapshotted here, written by the recorder's thread while training goes on.
    The checkpoint's write is timed into `estimates` (the time-limit watch's).
    """
    flush, best = job._decide(trainer, progress, metrics) if due.validate else (False, None)
    if due.validate:
        logger.log(metrics, step=metric_x(job.spec.train, progress.history[-1]))
    progress.timing = estimates.as_state()
    extra = {**asdict(progress), "run": job._run_identity()}
    if due.checkpoint:
        state = host_copy(training_state(trainer.model, trainer.optimizer, trainer.scaler, extra))
    elif best is not None:  # the weights alone
        state = {"model": host_copy(unwrap(trainer.model).state_dict())}

    def write() -> None:
        if flush:
            logger.flush()
        if best is not None:
            save_best_weights(state["model"], job.spec.out_dir / "best.pt", best)
        if due.checkpoint:
            started = time.monotonic()
            save_checkpoint(state, job.checkpoint_dir)
            estimates.save_s = time.monotonic() - started
            job.saved_step = int(state["step"])
        if line:
            print(f"{line} {progress_line(metrics)}", flush=True)

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
    due: Due = EPOCH_END,
    line: str = "",
) -> None:
    """An fsdp boundary's side effects, on every rank (the validation metrics, hence the
    decisions, are the same on all): with a validation the best weights gathered whole into
    rank 0's best.pt; with `due.checkpoint` the sharded checkpoint started by all ranks
    (written while training goes on, one in flight: ShardedSaver, which times it into
    `estimates`); then rank 0 logs and prints through the recorder."""
    ctx = trainer.dist
    flush, best = job._decide(trainer, progress, metrics) if due.validate else (False, None)
    if best is not None:
        weights = full_weights(trainer.model)  # collective
        if ctx.is_main:
            save_best_weights(weights, job.spec.out_dir / "best.pt", best)
    if due.checkpoint:
        progress.timing = estimates.as_state()
        extra = {**asdict(progress), "run": job._run_identity()}
        train_state = {"scaler": trainer.scaler.state_dict(), "rng": rng_state(), **extra}
        where = (progress.epoch, progress.epoch_batches)
        saver.save(trainer.model, trainer.optimizer, train_state, job.checkpoint_dir, *where)
        job.saved_step = progress.step
    if not ctx.is_main or not due.validate:
        return
    logger.log(metrics, step=metric_x(job.spec.train, progress.history[-1]))

    def write() -> None:
        if flush:
            logger.flush()
        if line:
            print(f"{line} {progress_line(metrics)}", flush=True)

    recorder.submit(write)
