"""The training job: the callable submitit runs once per rank.

It builds what training needs (process group, model, data, optimizer, the run's plan) and
resumes from its latest checkpoint by itself, so a requeued, retried or re-submitted job
continues where the last one stopped; then the recipe (tasks.train.recipe) trains, validates,
checkpoints and stops, and the job tests the best weights and returns them. It knows nothing
of Slurm or Prefect.
"""

import random
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import submitit
import torch

from trainflow.cluster.heartbeat import Heartbeat
from trainflow.cluster.snapshot import code_first
from trainflow.console import say
from trainflow.errors import ConfigError
from trainflow.tasks.objectives import Objective, make_objective
from trainflow.tasks.preprocess.ref import dataset_spec
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.tracking.journal import opened
from trainflow.tasks.tracking.logger import make_logger
from trainflow.tasks.tracking.system_metrics import node_monitor
from trainflow.tasks.train.cadence import RunPlan, run_plan
from trainflow.tasks.train.checkpointing.checkpoint import Resumable
from trainflow.tasks.train.checkpointing.recorder import EpochRecorder
from trainflow.tasks.train.checkpointing.sharded_checkpoint import find_resumable
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.data import load_split_to, steps_per_epoch
from trainflow.tasks.train.distributed import (
    DistContext,
    distributed,
    exit_fast_at_shutdown,
    wrap_ddp,
)
from trainflow.tasks.train.first_result import first_result
from trainflow.tasks.train.init_from import initialised
from trainflow.tasks.train.job_spec import TrainJobSpec
from trainflow.tasks.train.limits.early_signal import deliver_held_signal
from trainflow.tasks.train.limits.limit_requeue import (
    LimitRequeue,
    count_stalled,
)
from trainflow.tasks.train.limits.stragglers import step_timer
from trainflow.tasks.train.log_lines import announce
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.model_plugins import build_model, resolve_factory
from trainflow.tasks.train.models import (
    narrowest_conv,
    place_model,
    use_channels_last,
    uses_cuda_graphs,
)
from trainflow.tasks.train.monitor import monitor_for
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.parallel.mesh import on_job_mesh
from trainflow.tasks.train.parallel.pipeline import pipeline_step
from trainflow.tasks.train.precision import PrecisionPolicy, resolve_precision
from trainflow.tasks.train.progress import (
    Progress,
    check_same_run,
    finish_run,
    relog,
    run_identity,
)
from trainflow.tasks.train.recipe import EpochEnd, Recipe
from trainflow.tasks.train.ref import CheckpointRef
from trainflow.tasks.train.resume import (
    GlobalBatch,
    announce_global_batch,
    global_batch,
    restore,
)
from trainflow.tasks.train.schedule import schedule_for
from trainflow.tasks.train.sharded_init import build_on_rank, shard_from_rank0
from trainflow.tasks.train.sharding import checkpoint_activations, sharding_units
from trainflow.tasks.train.throughput import (
    NO_FLOPS,
    announce_flops,
)


class TrainingJob(submitit.helpers.Checkpointable):
    """Trains `spec.train` on `spec.dataset` in this rank; returns rank 0's best checkpoint.

    `epoch_end`: called after each epoch, may stop the training early (a pruned trial).
    `attempt` counts this job's runs (a requeue starts the next); `stalled`, the attempts
    before this one in a row that reached a time limit without a new checkpoint.
    """

    recipe: type[Recipe] = Recipe
    """The training loop this job runs over what it builds (a test may put its own)."""

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
        self.requeue: LimitRequeue | None = None
        """The running attempt's time-limit watch (None before it starts)."""

    @property
    def saved_step(self) -> int:
        """The step of the newest checkpoint this attempt wrote or resumed from (-1: none)."""
        return self.requeue.saved_step if self.requeue is not None else -1

    @property
    def data_spec(self) -> DataSpec:
        """What the model and the objective are told about the dataset."""
        return dataset_spec(self.spec.dataset, self.spec.train.objective)

    def objective(self) -> Objective:
        """The objective train.objective names, built for the dataset."""
        cfg = self.spec.train
        return make_objective(cfg.objective, self.data_spec, cfg.objective_args)

    def __call__(self) -> CheckpointRef | None:
        """Set up, resume if a checkpoint exists, train the rest of the run (the recipe),
        test the best weights, clean up."""
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
            # The time limit read, its requeue signal held (tasks.train.limits.limit_requeue),
            # then a requeue signal that came during start-up acts: a preemption's requeues now.
            self.requeue = requeue = LimitRequeue.for_job(spec, self.attempt, dist)
            deliver_held_signal()
            dist = on_job_mesh(dist, cfg)  # train.parallel's mesh: who takes which batches
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
            policy = resolve_precision(cfg.precision, dist.device)
            spec_ = self.data_spec  # the model, with train.init_from's weights if given
            model = build_on_rank(
                lambda: initialised(build_model(cfg, spec_), cfg.init_from), cfg.strategy, dist
            )
            # Each rank's log names the file its model was imported from (the code snapshot).
            say(f"model {cfg.model} from {resolve_factory(cfg).file}")
            narrowest = narrowest_conv(model)
            nhwc = use_channels_last(cfg.channels_last, dist.device, narrowest, cfg.strategy)
            heartbeat.beat("start-up")
            train, val = self._load("train", dist, nhwc), self._load("val", dist, nhwc)
            heartbeat.beat("start-up")
            if dist.is_main:
                announce(cfg, dist, policy, nhwc, train, journal)
            flops = NO_FLOPS
            if dist.is_main:  # counted once, on a meta copy of the model as built (before
                flops = announce_flops(  # FSDP, which cannot be copied, shards it)
                    model,
                    self.data_spec,
                    dist.device,
                    policy.name,
                    journal,
                )
            found = find_resumable(self.checkpoint_dir, cfg.strategy == "fsdp", dist)
            batch = global_batch(found, cfg, dist)  # kept across world sizes
            plan = plan_for(cfg, len(train), batch, dist)  # the run's length and cadence
            trainer = self._trainer(model, dist, policy, plan, batch)
            # Each rank's step times, compared every window on rank 0 (limits.stragglers)
            trainer = replace(trainer, timer=step_timer(cfg, trainer.model, dist, journal))
            progress = self._resume(trainer, found, plan, batch)
            requeue.resumed(progress, checkpointed=found is not None)
            if dist.is_main:
                announce_global_batch(batch, progress.epoch, journal)
            logger = recorder.closing(make_logger(journal))
            monitor = monitor_for(cfg, trainer.objective)  # the best validation, early stop
            requeue.keep = monitor.retain  # which checkpoints a save keeps
            relog(progress, logger, self.spec.out_dir)
            self.recipe(
                spec=spec,
                trainer=trainer,
                train=train,
                val=val,
                plan=plan,
                progress=progress,
                logger=logger,
                recorder=recorder,
                limit=requeue,
                monitor=monitor,
                flops=flops,
                epoch_end=self.epoch_end,
            ).run()  # train, validate, checkpoint, stop
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
        fresh.attempt, fresh.stalled, fresh.requeue = self.attempt + 1, stalled, None
        return submitit.helpers.DelayedSubmission(fresh)

    @property
    def checkpoint_dir(self) -> Path:
        """Where the full training state is written every epoch."""
        return self.spec.checkpoint_dir

    def _load(self, split: Literal["train", "val"], dist: DistContext, nhwc: bool) -> Split:
        """A split of the dataset, placed per train.data_placement."""
        placement = self.spec.train.data_placement
        return load_split_to(self.spec.dataset.path, split, dist.device, nhwc, placement)

    def _trainer(
        self,
        built: torch.nn.Module,
        dist: DistContext,
        policy: PrecisionPolicy,
        plan: RunPlan,
        batch: GlobalBatch,
    ) -> Trainer:
        """The model placed (and wrapped or sharded), its optimizer, and what each step needs
        for the run of `plan` in `batch`'s layout."""
        cfg = self.spec.train
        model = place_model(built, cfg, dist.device)
        if cfg.activation_checkpointing:
            checkpoint_activations(sharding_units(model))
        if cfg.strategy == "fsdp":  # the optimizer then holds this rank's shards only
            model = shard_from_rank0(model, dist, policy, cfg.reshard_after_forward)
            optimizer = make_optimizer(cfg, model)  # of this rank's pipeline stage under pp
        else:
            optimizer = make_optimizer(cfg, model)
            model = wrap_ddp(model, dist, cfg.ddp_bucket_cap_mb, batch.accumulation)
        total_steps = plan.total_steps
        objective = self.objective()
        return Trainer(
            model=model,
            optimizer=optimizer,
            scaler=policy.make_scaler(),
            policy=policy,
            dist=dist,
            objective=objective,
            peak_lr=cfg.lr,
            total_steps=total_steps,
            cuda_graphs=uses_cuda_graphs(cfg, dist.device),
            heartbeat=self._heartbeat,
            accumulation=batch.accumulation,
            schedule=schedule_for(cfg, total_steps),
            max_grad_norm=cfg.max_grad_norm,
            pipeline=pipeline_step(model, dist, cfg, objective, batch.accumulation),
        )

    def _resume(
        self, trainer: Trainer, found: Resumable | None, plan: RunPlan, batch: GlobalBatch
    ) -> Progress:
        """The run's progress: restored from `found` (the newest checkpoint of out_dir that
        verifies: find_resumable), or a fresh start's."""
        cfg = self.spec.train
        if found is None:
            return Progress(cfg.seed, data_world=batch.data_world, by_step=cfg.counts_steps)
        sharded = self.spec.train.strategy == "fsdp"
        progress = restore(trainer, found, self._run_identity(), plan.steps_per_epoch, sharded)
        progress.data_world = batch.data_world
        return progress

    def _run_identity(self) -> dict[str, Any]:
        """What a checkpoint must share with this job to be resumed by it."""
        return run_identity(self.spec.train, self.spec.dataset.content_hash)

    def _check_same_run(self, saved: dict[str, Any], path: Path) -> None:
        """ConfigError when the checkpoint in out_dir belongs to a different run."""
        check_same_run(self._run_identity(), saved, path)


def plan_for(cfg: TrainConfig, n_train: int, batch: GlobalBatch, dist: DistContext) -> RunPlan:
    """The run's length and cadence over `n_train` training samples in `batch`'s layout;
    ConfigError when no step would run."""
    steps = steps_per_epoch(n_train, cfg.batch_size, batch.data_world, cfg.same_shape_batches)
    if steps == 0:
        raise ConfigError(
            f"train.batch_size={cfg.batch_size} exceeds the {n_train // dist.dp_size} "
            "training samples each rank gets, and train.cuda_graphs=true or train.parallel.pp drop "
            "partial batches: no step would run. Lower train.batch_size or use fewer ranks"
        )
    return run_plan(cfg, steps)
