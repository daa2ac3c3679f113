"""The training recipe of one attempt, on every rank: train in segments, validate, checkpoint,
log, stop.

The job (tasks.train.job) builds the parts (model, data, trainer, resumed progress) and hands
them to `Recipe`; `Recipe.run` then reads top to bottom:

1. train from where the run is up to the plan's next boundary (tasks.train.cadence: an epoch's
   end, train.max_steps, a step of train.val_every_steps, checkpoint_every_steps or
   log_every_steps), the next segment going on in the same epoch from where this one stopped;
2. log the steps' metrics, validate, then record what is due: the history entry, best.pt,
   the checkpoint (rank 0's write of a ddp run on the recorder's thread, every rank's shards
   of an fsdp run through its ShardedSaver, one in flight), the progress line;
3. stop at the run's last step, when `epoch_end` says so (a pruned search trial), or before a
   time limit (the `limit` collaborator checkpoints where its watch stopped and requeues).

The collaborators never call back into the recipe: the time-limit watch (`limit`), the
heartbeat and the straggler timer (in the trainer), the search's `epoch_end` and the
recorder are told what happened and answer.
"""

import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import torch

from trainflow.console import say
from trainflow.tasks.tracking.logger import MetricLogger
from trainflow.tasks.train.cadence import Due, RunPlan
from trainflow.tasks.train.checkpointing.checkpoint import (
    host_copy,
    rng_state,
    save_best_weights,
    save_checkpoint,
    training_state,
    unwrap,
)
from trainflow.tasks.train.checkpointing.recorder import EpochRecorder
from trainflow.tasks.train.checkpointing.sharded_checkpoint import ShardedSaver, full_weights
from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.data import accumulated_batches
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job_spec import TrainJobSpec
from trainflow.tasks.train.limits.limit_requeue import LimitRequeue, StoppedForTimeLimit
from trainflow.tasks.train.log_lines import progress_line
from trainflow.tasks.train.loop import Trainer, evaluate_split, train_epoch
from trainflow.tasks.train.monitor import Monitor, Verdict
from trainflow.tasks.train.progress import Progress, best_meta, metric_x, run_identity
from trainflow.tasks.train.step_metrics import Position, Window
from trainflow.tasks.train.throughput import NO_FLOPS, FlopFacts, RankClock, epoch_throughput


class EpochEnd(Protocol):
    """Told of every epoch's metrics on every rank once the epoch is recorded (a search
    reports them to its study: tasks.search); True stops the training there. All ranks must
    return the same answer (the metrics are equal on all ranks; a decision made on one rank
    is broadcast)."""

    def __call__(self, epoch: int, metrics: dict[str, float], dist: DistContext) -> bool:
        """Whether to stop after `epoch`."""
        ...


@dataclass
class EpochWork:
    """This attempt's work in the epoch so far, over its segments (for its throughput)."""

    samples: int = 0
    """This rank's samples."""
    steps: int = 0
    seconds: float = 0.0
    """This rank's time in the loop (RankClock's)."""
    elapsed: float = 0.0
    """Wall time in the loop."""
    count: float = 0.0
    """Samples of all ranks."""
    started: float = field(default_factory=time.perf_counter)

    def add(self, samples: int, steps: int, seconds: float, elapsed: float, count: float) -> None:
        """A segment's work."""
        self.samples += samples
        self.steps += steps
        self.seconds += seconds
        self.elapsed += elapsed
        self.count += count


@dataclass
class Recipe:
    """One attempt's training loop over built parts (see the module docstring)."""

    spec: TrainJobSpec
    trainer: Trainer
    train: Split
    val: Split
    plan: RunPlan
    """The run's length and cadence in optimizer steps."""
    progress: Progress
    """Where the run is (resumed, or a fresh start's); advanced on every rank."""
    logger: MetricLogger
    """Rank 0's metric logger (a NullLogger elsewhere)."""
    recorder: EpochRecorder
    """Rank 0's writer thread of records and checkpoints."""
    limit: LimitRequeue
    """The time-limit watch: where to stop, then checkpoint there and requeue."""
    monitor: Monitor
    """train.monitor: which validation is the best, when the run has stopped improving, which
    checkpoints a save keeps (tasks.train.monitor)."""
    flops: FlopFacts = NO_FLOPS
    """The model's FLOPs per sample and the device's peak (rank 0), for MFU."""
    epoch_end: EpochEnd | None = None
    """A search's hook after each epoch: True stops the training."""
    work: EpochWork = field(default_factory=EpochWork)
    order: tuple[int, list[torch.Tensor]] = (0, [])
    """The epoch whose batches this rank takes, and their sample indices."""
    window: Window = field(default_factory=Window)
    """Rank 0's sums of the steps since the last per-step log (train.log_every_steps)."""

    def run(self) -> None:
        """Train to the run's last step (or an earlier stop), segment by segment. Under fsdp
        the last checkpoint is in place when this returns, and a failing job completes the
        one in flight if it can (ShardedSaver.settle)."""
        trainer, plan, progress = self.trainer, self.plan, self.progress
        fsdp = self.spec.train.strategy == "fsdp"
        saver = None
        if fsdp:
            saver = ShardedSaver(trainer.dist, self.limit.save_took, self.monitor.retain)
        position = Position(plan, progress.by_step)
        position.start(progress.step)
        try:  # (a run resumed after its early stop trains no further)
            while progress.step < plan.total_steps and not self.monitor.stopped(progress):
                try:
                    metrics, due = self.segment()
                except StoppedForTimeLimit:  # `progress` says where: save there, requeue
                    self.limit.checkpoint_and_requeue(trainer, progress, self.recorder, saver)
                if due.log and trainer.dist.is_main:
                    self.recorder.flush_when_idle(self.logger)
                if not (due.validate or due.checkpoint):
                    continue
                verdict = self.observe(metrics) if due.validate else None  # best? stop?
                if verdict is not None and verdict.stop:  # the stop's state is checkpointed
                    due = replace(due, checkpoint=True)  # (a resume trains no further)
                trainer.heartbeat.beat("checkpoint", progress.step)
                line = position.line(progress.epoch, progress.step, due) if due.validate else ""
                self.record(metrics, due, line, saver)
                # a search's pruner asks first (a pruned trial), then early stopping
                if due.epoch_end and self.stops_after(metrics):
                    break
                if verdict is not None and verdict.stop:
                    if trainer.dist.is_main:  # after the validation's own line
                        self.recorder.submit(partial(say, verdict.line))
                    break
        except BaseException:
            if saver is not None:
                saver.settle()
            raise
        if saver is not None:
            saver.wait()

    def stops_after(self, metrics: dict[str, float]) -> bool:
        """Whether `epoch_end` (a search's pruner) stops the run after this epoch."""
        hook = self.epoch_end
        return hook is not None and hook(self.progress.epoch, metrics, self.trainer.dist)

    def segment(self) -> tuple[dict[str, float], Due]:
        """Train from the run's position up to the plan's next boundary, then log the steps
        and validate there if due; advances `progress` (on every rank) and returns the
        metrics (the epoch's so far, with a validation's) and what is due.
        StoppedForTimeLimit when the time-limit watch stopped it earlier (`progress` then
        says where)."""
        cfg, trainer, plan, progress = self.spec.train, self.trainer, self.plan, self.progress
        dist, accumulation = trainer.dist, trainer.accumulation
        if progress.epoch_batches == 0:
            self.work = EpochWork()
        epoch, steps = progress.epoch + 1, plan.next_boundary(progress.step) - progress.step
        if self.order[0] != epoch:  # the epoch's order, drawn once for all its segments
            self.order = (
                epoch,
                accumulated_batches(
                    self.train,
                    cfg.batch_size,
                    progress.data_seed,
                    epoch,
                    dist.dp_rank,
                    dist.dp_size,
                    accumulation,
                    drop_last=cfg.same_shape_batches,
                ),
            )
        first = progress.epoch_batches * accumulation  # inside an epoch: where it stopped
        batches = self.order[1][first : first + steps * accumulation]
        started, before = time.perf_counter(), list(progress.epoch_sums)
        clock = RankClock(dist.device)
        stop = self.limit.epoch(progress, plan.next_pause(progress.step))
        metrics, progress.step = train_epoch(
            trainer, self.train, batches, progress.step, clock, stop
        )
        progress.epoch_batches += stop.done
        progress.epoch_sums = stop.totals
        if stop.done < steps:
            raise StoppedForTimeLimit
        seconds, work = time.perf_counter() - started, self.work
        counted = stop.totals[-1] - (before[-1] if before else 0.0)  # all ranks' samples
        work.add(sum(int(b.shape[0]) for b in batches), steps, clock.seconds, seconds, counted)
        metrics["samples_per_s"] = work.count / max(work.elapsed, 1e-9)
        due = plan.due(progress.step)
        if plan.log_every and dist.is_main:
            self.window.add(stop.totals, before, seconds)
            if due.log:
                clipped, lr = trainer.max_grad_norm > 0, metrics["lr"]
                window = self.window.take(trainer.objective, clipped, lr)
                self.logger.log(window, step=progress.step)
        if due.epoch_end:
            progress.epoch, progress.epoch_batches, progress.epoch_sums = epoch, 0, []
            parts = trainer.timer.take_epoch()
            metrics |= epoch_throughput(
                work.samples, work.steps, work.seconds, dist, self.flops, parts
            )
        if due.validate:
            self.validate(metrics, due)
        return metrics, due

    def validate(self, metrics: dict[str, float], due: Due) -> None:
        """Add the validation split's metrics to `metrics` and the entry to the history."""
        trainer, progress = self.trainer, self.progress
        validated = time.monotonic()
        val_metrics = evaluate_split(
            trainer.model,
            self.val,
            4 * self.spec.train.batch_size,
            trainer.policy,
            trainer.dist,
            trainer.objective,
            trainer.cuda_graphs,
            trainer.heartbeat,
            trainer.pipeline,
        )
        metrics |= {f"val_{k}": v for k, v in val_metrics.items()}
        self.limit.limit.estimates.eval_s = time.monotonic() - validated
        if due.epoch_end:
            metrics["epoch_time_s"] = time.perf_counter() - self.work.started
        place = {"epoch": progress.epoch, "step": progress.step}
        if progress.epoch_batches:  # inside an epoch: where, as a checkpoint there is named
            place["epoch_batches"] = progress.epoch_batches
        progress.history.append({**place, **metrics})

    def observe(self, metrics: dict[str, float]) -> Verdict:
        """After a validation (the last history entry): whether it is the best so far and
        whether the run has stopped improving (tasks.train.monitor; kept in `progress`, on
        every rank)."""
        progress = self.progress
        return self.monitor.observe(progress, metrics, position=len(progress.history))

    def decide(self, metrics: dict[str, float]) -> tuple[bool, dict[str, Any] | None]:
        """After a validation: (whether it flushes the logger, best.pt's meta when the
        monitor made it the best so far, else None); updates `progress.logged_epochs`. An
        epoch's end flushes every train.log_every_epochs epochs; a validation inside an epoch
        and the run's last always do."""
        cfg, progress = self.spec.train, self.progress
        inside, last = progress.epoch_batches > 0, progress.step >= self.plan.total_steps
        flush = inside or last or progress.epoch % cfg.log_every_epochs == 0
        if flush:
            progress.logged_epochs = len(progress.history)
        if progress.best_epoch == len(progress.history):  # the monitor's choice (observe)
            return flush, best_meta(cfg, self.spec.dataset, progress)
        return flush, None

    def record(
        self, metrics: dict[str, float], due: Due, line: str, saver: ShardedSaver | None
    ) -> None:
        """What a boundary leaves: with a validation the logged metrics, best.pt and the
        progress `line`; with `due.checkpoint` the checkpoint. Decided and snapshotted here,
        written while training goes on: rank 0's recorder thread writes a ddp run's; every
        rank starts its shards of an fsdp run's through `saver` (one save in flight)."""
        trainer, progress, ctx = self.trainer, self.progress, self.trainer.dist
        flush, best = self.decide(metrics) if due.validate else (False, None)
        if due.validate and ctx.is_main:
            self.logger.log(metrics, step=metric_x(progress, progress.history[-1]))
        progress.timing = self.limit.limit.estimates.as_state()
        identity = run_identity(self.spec.train, self.spec.dataset.content_hash)
        extra = {**asdict(progress), "run": identity}
        best_path, state = self.spec.out_dir / "best.pt", None
        if saver is not None:
            if best is not None:
                weights = full_weights(trainer.model, ctx)  # collective
                if ctx.is_main:
                    save_best_weights(weights, best_path, best)
                best = None
            if due.checkpoint:
                train_state = {"scaler": trainer.scaler.state_dict(), "rng": rng_state(), **extra}
                where = (progress.epoch, progress.epoch_batches)
                directory = self.spec.checkpoint_dir
                saver.save(trainer.model, trainer.optimizer, train_state, directory, *where)
                self.limit.saved_step = progress.step
        elif due.checkpoint:
            state = host_copy(
                training_state(trainer.model, trainer.optimizer, trainer.scaler, extra)
            )
        elif best is not None:  # the weights alone
            state = {"model": host_copy(unwrap(trainer.model).state_dict())}
        if not ctx.is_main:
            return
        checkpoint = due.checkpoint and saver is None
        limit, logger, directory = self.limit, self.logger, self.spec.checkpoint_dir

        def write() -> None:
            if flush:
                logger.flush()
            if best is not None and state is not None:
                save_best_weights(state["model"], best_path, best)
            if checkpoint and state is not None:
                started = time.monotonic()
                save_checkpoint(state, directory, limit.keep)
                limit.save_took(time.monotonic() - started)
                limit.saved_step = int(state["step"])
            if line:
                say(f"{line} {progress_line(metrics)}")

        self.recorder.submit(write)
