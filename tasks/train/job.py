"""The training job: the callable submitit runs once per rank.

It knows nothing of Slurm or Prefect. It resumes from its latest checkpoint by itself, so a
requeued, retried or re-submitted job continues where the last one stopped.
"""

import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import submitit
import torch

from trainflow.cluster.heartbeat import NO_HEARTBEAT, Heartbeat
from trainflow.cluster.snapshot import code_first
from trainflow.errors import ConfigError
from trainflow.tasks.objectives import Objective, make_objective
from trainflow.tasks.preprocess.ref import dataset_spec
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.tracking.journal import opened
from trainflow.tasks.tracking.logger import MetricLogger, make_logger
from trainflow.tasks.tracking.system_metrics import node_monitor
from trainflow.tasks.train.cadence import EPOCH_END, Due, RunPlan, run_plan
from trainflow.tasks.train.checkpoint import Resumable
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.data import accumulated_batches, load_split_to, steps_per_epoch
from trainflow.tasks.train.distributed import (
    DistContext,
    distributed,
    exit_fast_at_shutdown,
    wrap_ddp,
)
from trainflow.tasks.train.early_signal import deliver_held_signal
from trainflow.tasks.train.epoch_records import decide, record, record_sharded
from trainflow.tasks.train.first_result import first_result
from trainflow.tasks.train.init_from import initialised
from trainflow.tasks.train.job_spec import TrainJobSpec
from trainflow.tasks.train.limit_requeue import (
    LimitRequeue,
    StoppedForTimeLimit,
    count_stalled,
)
from trainflow.tasks.train.log_lines import announce
from trainflow.tasks.train.loop import Trainer, evaluate_split, train_epoch
from trainflow.tasks.train.model_plugins import build_model, resolve_factory
from trainflow.tasks.train.models import (
    narrowest_conv,
    place_model,
    use_channels_last,
    uses_cuda_graphs,
)
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.precision import PrecisionPolicy, resolve_precision
from trainflow.tasks.train.progress import (
    Progress,
    check_same_run,
    finish_run,
    relog,
    run_identity,
)
from trainflow.tasks.train.recorder import EpochRecorder
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.resume import (
    GlobalBatch,
    announce_global_batch,
    global_batch,
    restore,
)
from trainflow.tasks.train.schedule import schedule_for
from trainflow.tasks.train.sharded_checkpoint import ShardedSaver, find_resumable
from trainflow.tasks.train.sharded_init import build_on_rank, shard_from_rank0
from trainflow.tasks.train.sharding import checkpoint_activations, sharding_units
from trainflow.tasks.train.step_metrics import Position, window_metrics
from trainflow.tasks.train.stragglers import step_timer
from trainflow.tasks.train.throughput import (
    NO_FLOPS,
    RankClock,
    announce_flops,
    epoch_throughput,
)


class EpochEnd(Protocol):
    """Told of every epoch's metrics on every rank once the epoch is recorded (a search
    reports them to its study: tasks.search); True stops the training there. All ranks must
    return the same answer (the metrics are equal on all ranks; a decision made on one rank
    is broadcast)."""

    def __call__(self, epoch: int, metrics: dict[str, float], dist: DistContext) -> bool:
        """Whether to stop after `epoch`."""
        ...


class TrainingJob(submitit.helpers.Checkpointable):
    """Trains `spec.train` on `spec.dataset` in this rank; returns rank 0's best checkpoint.

    `epoch_end`: called after each epoch, may stop the training early (a pruned trial).
    `attempt` counts this job's runs (a requeue starts the next); `stalled`, the attempts
    before this one in a row that reached a time limit without a new checkpoint.
    """

    saved_step: int = -1
    """The step of the newest checkpoint this attempt wrote or resumed from (-1: none)."""

    def __init__(
        self,
        spec: TrainJobSpec,
        epoch_end: EpochEnd | None = None,
        attempt: int = 1,
        stalled: int = 0,
    ) -> None:
        self.spec = spec
        self.epoch_end = epoch_end
        self.attempt = attempt
        self.stalled = stalled

    @property
    def data_spec(self) -> DataSpec:
        """What the model and the objective are told about the dataset."""
        return dataset_spec(self.spec.dataset, self.spec.train.objective)

    def objective(self) -> Objective:
        """The objective train.objective names, built for the dataset."""
        cfg = self.spec.train
        return make_objective(cfg.objective, self.data_spec, cfg.objective_args)

    def __call__(self) -> CheckpointRef | None:
        """Set up, resume if a checkpoint exists, train the remaining epochs, clean up."""
        spec, cfg = self.spec, self.spec.train
        # Progress for this rank's guard (cluster.rank_guard): a rank silent for longer than
        # its phase allows is declared hung, its stacks dumped, and the job restarted.
        self._heartbeat = heartbeat = Heartbeat.from_env(cfg.hang_timeout_s, cfg.hang_first_step_s)
        heartbeat.beat("start-up", 0)
        code_first(spec.code)  # the user's code as submitted, not as the files hold it now
        torch.set_num_threads(spec.cpus_per_task)
        run_out = spec.out_dir if spec.tracking_uri and spec.run_id else None  # a run to log
        with (
            distributed(cfg.device) as dist,
            node_monitor(run_out, dist.local_rank, spec.system_metrics_interval_s),
            # Rank 0's record of the run; the flow sends it to MLflow (tasks.tracking.relay).
            opened(run_out if dist.is_main else None, "rank0") as journal,
            EpochRecorder() as recorder,  # exits first: its logger's last flush is journaled
        ):
            # The time limit read, its requeue signal held (tasks.train.limit_requeue), then a
            # requeue signal that came during start-up acts: a preemption's requeues now.
            self._requeue = LimitRequeue.for_job(self, dist)
            deliver_held_signal()
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            policy = resolve_precision(cfg.precision, dist.device)
            spec_ = self.data_spec  # the model, with train.init_from's weights if given
            model = build_on_rank(
                lambda: initialised(build_model(cfg, spec_), cfg.init_from), cfg.strategy, dist
            )
            # Each rank's log names the file its model was imported from (the code snapshot).
            print(f"model {cfg.model} from {resolve_factory(cfg).file}", flush=True)
            narrowest = narrowest_conv(model)
            nhwc = use_channels_last(cfg.channels_last, dist.device, narrowest, cfg.strategy)
            heartbeat.beat("start-up")
            train, val = self._load("train", dist, nhwc), self._load("val", dist, nhwc)
            heartbeat.beat("start-up")
            if dist.is_main:
                announce(cfg, dist, policy, nhwc, train, journal)
            self._flops = NO_FLOPS
            if dist.is_main:  # counted once, on a meta copy of the model as built (before
                self._flops = announce_flops(  # FSDP, which cannot be copied, shards it)
                    model,
                    self.data_spec,
                    dist.device,
                    policy.name,
                    journal,
                )
            found = find_resumable(self.checkpoint_dir, cfg.strategy == "fsdp", dist)
            self._batch = global_batch(found, cfg.batch_size, dist)  # kept across world sizes
            self._plan = plan_for(cfg, len(train), self._batch, dist)  # length and cadence
            trainer = self._trainer(model, dist, policy, len(train))
            # Each rank's step times, compared every window on rank 0 (tasks.train.stragglers)
            trainer = replace(trainer, timer=step_timer(cfg, trainer.model, dist, journal))
            progress = self._resume(trainer, found)
            self._requeue.resumed(progress)
            if dist.is_main:
                announce_global_batch(self._batch, progress.epoch, journal)
            logger = recorder.closing(make_logger(journal, spec.out_dir))
            relog(progress, logger, self.spec.out_dir, cfg.counts_steps)
            self._train(trainer, train, val, progress, logger, recorder)
            heartbeat.beat("checkpoint")
            recorder.wait()  # the last epoch's line, best.pt and checkpoint are written
            del train, val
            path, out = spec.dataset.path, spec.out_dir
            heartbeat.beat("evaluation")
            tested = first_result(trainer, cfg, path, out, progress, nhwc, logger)
            result = finish_run(out, progress, tested) if dist.is_main else None
            heartbeat.beat("shut-down")
        if not (cfg.compile or cfg.cuda_graphs):  # compiled runs keep the teardown that
            exit_fast_at_shutdown(trainer)  # stops inductor's compile workers
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """On timeout or preemption (submitit calls this in rank 0, from its signal handler):
        requeue a fresh job, the next attempt; it resumes from disk by itself.

        StalledAtTimeLimit instead when this is the attempt past cluster.max_requeues in a row
        that reached its time limit without writing a checkpoint."""
        stalled = count_stalled(self)
        fresh = object.__new__(type(self))  # the spec and a subclass's own settings, no state
        fresh.__dict__.update({k: v for k, v in vars(self).items() if not k.startswith("_")})
        fresh.attempt, fresh.stalled, fresh.saved_step = self.attempt + 1, stalled, -1
        return submitit.helpers.DelayedSubmission(fresh)

    @property
    def checkpoint_dir(self) -> Path:
        """Where the full training state is written every epoch."""
        return self.spec.out_dir / "checkpoints"

    def _load(self, split: Literal["train", "val"], dist: DistContext, nhwc: bool) -> Split:
        """A split of the dataset, placed per train.data_placement."""
        placement = self.spec.train.data_placement
        return load_split_to(self.spec.dataset.path, split, dist.device, nhwc, placement)

    def _trainer(
        self, built: torch.nn.Module, dist: DistContext, policy: PrecisionPolicy, n_train: int
    ) -> Trainer:
        cfg = self.spec.train
        model = place_model(built, cfg, dist.device)
        if cfg.activation_checkpointing:
            checkpoint_activations(sharding_units(model))
        if cfg.strategy == "fsdp":  # the optimizer then holds this rank's shards only
            model = shard_from_rank0(model, dist, policy, cfg.reshard_after_forward)
            optimizer = make_optimizer(cfg, model)
        else:
            optimizer = make_optimizer(cfg, model)
            model = wrap_ddp(model, dist, cfg.ddp_bucket_cap_mb)
        batch = getattr(self, "_batch", None) or global_batch(None, cfg.batch_size, dist)
        total_steps = plan_for(cfg, n_train, batch, dist).total_steps
        return Trainer(
            model=model,
            optimizer=optimizer,
            scaler=policy.make_scaler(),
            policy=policy,
            dist=dist,
            objective=self.objective(),
            peak_lr=cfg.lr,
            total_steps=total_steps,
            cuda_graphs=uses_cuda_graphs(cfg, dist.device),
            heartbeat=getattr(self, "_heartbeat", NO_HEARTBEAT),
            accumulation=batch.accumulation,
            schedule=schedule_for(cfg, total_steps),
            max_grad_norm=cfg.max_grad_norm,
        )

    def _resume(self, trainer: Trainer, found: Resumable | None) -> Progress:
        """The run's progress: restored from `found` (the newest checkpoint of out_dir that
        verifies: find_resumable), or a fresh start's."""
        batch = getattr(self, "_batch", None)
        data_world = batch.data_world if batch is not None else trainer.dist.world_size
        if found is None:
            return Progress(data_seed=self.spec.train.seed, data_world=data_world)
        sharded, per_epoch = self.spec.train.strategy == "fsdp", self._plan.steps_per_epoch
        progress = restore(trainer, found, self._run_identity(), per_epoch, sharded)
        progress.data_world = data_world
        self.saved_step = progress.step
        return progress

    def _run_identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this job to be resumed by it."""
        return run_identity(self.spec.train, self.spec.dataset.content_hash)

    def _check_same_run(self, saved: dict[str, Any], path: Path) -> None:
        """ConfigError when the checkpoint in out_dir belongs to a different run."""
        check_same_run(self._run_identity(), saved, path)

    def _train(
        self,
        trainer: Trainer,
        train: Split,
        val: Split,
        progress: Progress,
        logger: MetricLogger,
        recorder: EpochRecorder,
    ) -> None:
        """Train to the run's last step in segments, each up to the plan's next boundary
        (tasks.train.cadence: an epoch's end, train.max_steps, a step cadence), doing there
        what is due: log the steps, validate, checkpoint, print the line, ask `epoch_end`.
        Before a time limit, checkpoint where the watch stopped and requeue
        (tasks.train.limit_requeue). Under fsdp every rank writes its shards of each checkpoint
        (one in flight); the last is in place when this returns, and a failing job completes
        the one in flight if it can (ShardedSaver.settle)."""
        cfg, requeue, plan = self.spec.train, self._requeue, self._plan
        saver = ShardedSaver(trainer.dist, requeue.save_took) if cfg.strategy == "fsdp" else None
        position = Position(plan, cfg.counts_steps)
        position.start(progress.step)
        self._epoch = EpochWork()
        try:
            while progress.step < plan.total_steps:
                try:
                    metrics, due = self._run_segment(trainer, train, val, progress, logger)
                except StoppedForTimeLimit:  # `progress` says where: save there, requeue
                    requeue.checkpoint_and_requeue(trainer, progress, recorder, saver)
                if due.log and trainer.dist.is_main:
                    recorder.flush_when_idle(logger)
                if not (due.validate or due.checkpoint):
                    continue
                trainer.heartbeat.beat("checkpoint", progress.step)
                line = position.line(progress.epoch, progress.step, due) if due.validate else ""
                if saver is not None:
                    self._record_sharded(
                        trainer, progress, metrics, logger, recorder, saver, due, line
                    )
                elif trainer.dist.is_main:
                    self._record(trainer, progress, metrics, logger, recorder, due, line)
                if (
                    due.epoch_end
                    and self.epoch_end is not None
                    and self.epoch_end(progress.epoch, metrics, trainer.dist)
                ):
                    break
        except BaseException:
            if saver is not None:
                saver.settle()
            raise
        if saver is not None:
            saver.wait()

    def _run_segment(
        self,
        trainer: Trainer,
        train: Split,
        val: Split,
        progress: Progress,
        logger: MetricLogger,
    ) -> tuple[dict[str, float], Due]:
        """Train from `progress` up to the plan's next boundary, then log the steps and
        validate there if due (tasks.train.cadence); advances `progress` (on every rank) and
        returns the metrics (the epoch's so far, with a validation's) and what is due.
        StoppedForTimeLimit when the time-limit watch stopped it earlier (`progress` then
        says where)."""
        cfg, dist, plan = self.spec.train, trainer.dist, self._plan
        if progress.epoch_batches == 0:
            self._epoch = EpochWork()
        work, epoch = self._epoch, progress.epoch + 1
        steps = plan.next_boundary(progress.step) - progress.step
        first = progress.epoch_batches * trainer.accumulation  # mid-epoch: where it stopped
        batches = accumulated_batches(
            train,
            cfg.batch_size,
            progress.data_seed,
            epoch,
            dist.rank,
            dist.world_size,
            trainer.accumulation,
            drop_last=cfg.cuda_graphs,
        )[first : first + steps * trainer.accumulation]
        started, before = time.perf_counter(), list(progress.epoch_sums)
        clock = RankClock(dist.device)
        stop = self._requeue.epoch(progress, steps)
        metrics, progress.step = train_epoch(trainer, train, batches, progress.step, clock, stop)
        progress.epoch_batches += stop.done
        progress.epoch_sums = stop.totals
        if stop.done < steps:
            raise StoppedForTimeLimit
        seconds = time.perf_counter() - started
        work.add(sum(int(b.shape[0]) for b in batches), steps, clock.seconds, seconds)
        work.count += stop.totals[-1] - (before[-1] if before else 0.0)
        metrics["samples_per_s"] = work.count / max(work.elapsed, 1e-9)
        due = plan.due(progress.step)
        if due.log and dist.is_main:
            clipped = trainer.max_grad_norm > 0
            lr = metrics["lr"]
            objective = trainer.objective
            window = window_metrics(objective, stop.totals, before, clipped, seconds, lr)
            logger.log(window, step=progress.step)
        if due.epoch_end:
            progress.epoch, progress.epoch_batches, progress.epoch_sums = epoch, 0, []
            parts = trainer.timer.take_epoch()
            metrics |= epoch_throughput(
                work.samples, work.steps, work.seconds, dist, self._flops, parts
            )
        if not due.validate:
            return metrics, due
        validated = time.monotonic()
        val_metrics = evaluate_split(
            trainer.model,
            val,
            4 * cfg.batch_size,
            trainer.policy,
            dist,
            trainer.objective,
            trainer.cuda_graphs,
            trainer.heartbeat,
        )
        metrics |= {f"val_{k}": v for k, v in val_metrics.items()}
        self._requeue.limit.estimates.eval_s = time.monotonic() - validated
        if due.epoch_end:
            metrics["epoch_time_s"] = time.perf_counter() - work.started
        progress.history.append({"epoch": progress.epoch, "step": progress.step, **metrics})
        return metrics, due

    def _record(
        self,
        trainer: Trainer,
        progress: Progress,
        metrics: dict[str, float],
        logger: MetricLogger,
        recorder: EpochRecorder,
        due: Due = EPOCH_END,
        line: str = "",
    ) -> None:
        """Rank 0's side effects of a boundary (tasks.train.epoch_records.record)."""
        estimates = self._requeue.limit.estimates
        record(self, trainer, progress, metrics, logger, recorder, estimates, due, line)

    def _decide(
        self, trainer: Trainer, progress: Progress, metrics: dict[str, float]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether this epoch flushes the logger, and best.pt's meta if it is the best so far
        (tasks.train.epoch_records.decide)."""
        return decide(self, trainer, progress, metrics)

    def _record_sharded(
        self,
        trainer: Trainer,
        progress: Progress,
        metrics: dict[str, float],
        logger: MetricLogger,
        recorder: EpochRecorder,
        saver: ShardedSaver,
        due: Due = EPOCH_END,
        line: str = "",
    ) -> None:
        """An fsdp boundary's side effects (tasks.train.epoch_records.record_sharded)."""
        estimates = self._requeue.limit.estimates
        record_sharded(
            self, trainer, progress, metrics, logger, recorder, saver, estimates, due, line
        )


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

    def add(self, samples: int, steps: int, seconds: float, elapsed: float) -> None:
        """A segment's work."""
        self.samples += samples
        self.steps += steps
        self.seconds += seconds
        self.elapsed += elapsed


def plan_for(cfg: TrainConfig, n_train: int, batch: GlobalBatch, dist: DistContext) -> RunPlan:
    """The run's length and cadence over `n_train` training samples in `batch`'s layout;
    ConfigError when no step would run."""
    steps = steps_per_epoch(n_train, cfg.batch_size, batch.data_world, cfg.cuda_graphs)
    if steps == 0:
        raise ConfigError(
            f"train.batch_size={cfg.batch_size} exceeds the {n_train // dist.world_size} "
            "training samples each rank gets, and train.cuda_graphs=true drops partial "
            "batches: no step would run. Lower train.batch_size or use fewer ranks"
        )
    return run_plan(cfg, steps)
