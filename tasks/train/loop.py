"""The training and evaluation loops of one epoch.

The loss is the objective's (tasks.objectives); its metrics are summed on the device and read
once per call, an epoch or a segment of one (one all_reduce, one host sync): an ``.item()``
per step would stall the GPU queue every step.
"""

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from trainflow.cluster.heartbeat import NO_HEARTBEAT, Heartbeat
from trainflow.tasks.objectives import Objective
from trainflow.tasks.train.checkpointing.checkpoint import unwrap
from trainflow.tasks.train.clipping import clip_gradients
from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.data import eval_batches
from trainflow.tasks.train.distributed import DistContext, all_reduce_sum, gradient_sync
from trainflow.tasks.train.limits.step_times import NO_TIMER, StepTimer
from trainflow.tasks.train.outputs import logits_of
from trainflow.tasks.train.precision import PrecisionPolicy
from trainflow.tasks.train.prefetch import Batch
from trainflow.tasks.train.schedule import Schedule
from trainflow.tasks.train.sharding import is_sharded
from trainflow.tasks.train.throughput import RankClock

if TYPE_CHECKING:  # imports torch.distributed.pipelining: only a pipelined run needs it
    from trainflow.tasks.train.parallel.pipeline import PipelineStep


@dataclass(frozen=True)
class Trainer:
    """What every optimiser step needs."""

    model: nn.Module
    """The model, DDP-wrapped when world_size > 1."""
    optimizer: torch.optim.Optimizer
    """AdamW or SGD; its learning rate is set every step by `schedule`."""
    scaler: torch.amp.GradScaler
    """Loss scaler (enabled only under fp16)."""
    policy: PrecisionPolicy
    """Autocast dtype of forward passes."""
    dist: DistContext
    """Rank layout and device."""
    objective: Objective
    """Loss and metrics."""
    peak_lr: float
    """The schedule's peak learning rate (train.lr)."""
    total_steps: int
    """Optimizer steps of the whole run: the schedule ends here."""
    cuda_graphs: bool = False
    """The model replays CUDA graphs (compiled with mode="reduce-overhead"): each step then
    tells torch a new iteration begins, so the graphs' outputs of the last one may be reused."""
    heartbeat: Heartbeat = NO_HEARTBEAT
    """Told of every batch fetched and step started (cluster.heartbeat): off by default."""
    accumulation: int = 1
    """Micro-batches per rank and optimizer step (tasks.train.batching: train.global_batch_size
    or train.grad_accumulation, or a run resumed on fewer ranks that keeps its global batch);
    their gradients add up before the step, all-reduced under DDP in the last one only."""
    timer: StepTimer = NO_TIMER
    """Told when each step waits for data, starts and ends (tasks.train.limits.step_times)."""
    max_grad_norm: float = 0.0
    """Clip the gradients' global norm to this before each optimizer step (train.max_grad_norm);
    0: no clipping, no norm computed."""
    schedule: Schedule = field(default_factory=Schedule)
    """The learning rate's shape over the run (tasks.train.schedule): cosine to 0 unless set."""
    pipeline: "PipelineStep | None" = None
    """train.parallel.pp above 1: `model` is this rank's stage, and this runs its forward and
    backward passes through the pipeline (tasks.train.parallel.pipeline)."""

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step`."""
        return self.schedule.lr(step, self.total_steps, self.peak_lr)


def _train_step(
    trainer: Trainer, micro_batches: Iterator[Batch], lr: float
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """One optimiser step over `trainer.accumulation` micro-batches (each loss divided by
    their number, so the gradients average as over the ranks they stand for); returns their
    metric sums (on device), sample count, and the gradients' global norm before clipping
    (None without clipping)."""
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    pipeline = trainer.pipeline
    if pipeline is not None:  # the schedule runs the stages' passes, micro-batch by micro-batch
        trainer.optimizer.zero_grad(set_to_none=True)
        sums, count = pipeline.accumulate(micro_batches, trainer.policy, trainer.heartbeat)
    else:
        sums, count = _accumulate(trainer, micro_batches)
    norm = None
    if trainer.max_grad_norm > 0:
        trainer.scaler.unscale_(trainer.optimizer)  # fp16: clip true gradients (else a no-op)
        stages = pipeline.group if pipeline is not None else None  # the norm of every stage's
        norm = clip_gradients(trainer.model, trainer.max_grad_norm, stages)
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    return sums, count, norm


def _accumulate(trainer: Trainer, micro_batches: Iterator[Batch]) -> tuple[torch.Tensor, int]:
    """The forward and backward passes of the step's micro-batches, their gradients added up;
    returns their metric sums (on device) and sample count."""
    sums, count, micro = None, 0, -1
    for micro, (x, y) in enumerate(micro_batches):
        if trainer.cuda_graphs:  # each micro-batch's forward is an iteration of its own
            torch.compiler.cudagraph_mark_step_begin()
        # DDP all-reduces the gradients once, in the last micro-batch's backward
        with gradient_sync(trainer.model, micro == trainer.accumulation - 1):
            with trainer.policy.autocast():
                output = logits_of(trainer.model(x))
                loss = trainer.objective.loss(output, y)
            if micro == 0:
                trainer.optimizer.zero_grad(set_to_none=True)
            if trainer.accumulation > 1:
                loss = loss / trainer.accumulation
            trainer.heartbeat.beat("backward")
            trainer.scaler.scale(loss).backward()
        batch_sums = trainer.objective.sums(output.detach(), y)
        sums = batch_sums if sums is None else sums + batch_sums
        count += int(y.shape[0])
    assert sums is not None, "a step without a batch"
    # accumulated_batches gives every step all its micro-batches: else DDP never synced
    assert micro == trainer.accumulation - 1, f"{micro + 1} of {trainer.accumulation} batches"
    return sums, count


class EpochStop(Protocol):
    """Tells the loop where to stop early (tasks.train.limits.time_limit) and takes the sums so
    far."""

    carried: list[float]
    """Metric sums (count last) of the epoch's batches done before this call, all ranks'."""

    def should_stop(self, step: int) -> bool:
        """Whether to stop before `step`; asked on every rank at every step with a batch left."""
        ...

    def stopped(self, done: int, totals: list[float]) -> None:
        """The loop ended after `done` of its steps (all of them, or fewer when it stopped
        early), with these all-rank sums (the carried ones included, count last)."""
        ...


def train_epoch(
    trainer: Trainer,
    data: Split,
    batches: list[torch.Tensor],
    step: int,
    clock: RankClock | None = None,
    stop: EpochStop | None = None,
) -> tuple[dict[str, float], int]:
    """Train over `batches` starting at global `step`; returns (metrics, next step).

    Metrics: train_<the objective's metrics> (train_loss, train_accuracy...), samples_per_s
    (all ranks together), lr, and with clipping grad_norm (the mean over the epoch's steps of
    the global gradient norm before clipping; steps with an inf/nan norm, which fp16 skips,
    left out). `clock` stops when this rank's last step is done, before the
    ranks meet (tasks.train.throughput). `stop`: the epoch may end early (a time limit); its
    sums of the batches an earlier attempt did count too (rank 0 adds them).
    """
    device = trainer.dist.device
    trainer.model.train()
    objective = trainer.objective
    # the objective's sums, with clipping rank 0's norm sum and finite steps, the count last
    norms = 2 if trainer.max_grad_norm > 0 else 0
    sums = torch.zeros(objective.sums_size + norms + 1, dtype=torch.float64, device=device)
    if stop is not None and stop.carried and trainer.dist.is_main:
        sums += torch.tensor(stop.carried, dtype=torch.float64, device=device)
    done, steps = 0, -(-len(batches) // trainer.accumulation)  # steps of micro-batches
    lr = trainer.lr(step)
    start = time.perf_counter()
    beat, timer = trainer.heartbeat.beat, trainer.timer
    fetched = iter(data.batches(batches, device))
    while True:
        if stop is not None and done < steps and stop.should_stop(step):
            break
        beat("data", step)
        timer.data()
        try:
            x, y = next(fetched)
        except StopIteration:
            break
        timer.step()
        beat("step", step)
        lr = trainer.lr(step)
        micro = itertools.chain([(x, y)], itertools.islice(fetched, trainer.accumulation - 1))
        step_sums, count, norm = _train_step(trainer, micro, lr)
        sums[: objective.sums_size] += step_sums
        if norm is not None and trainer.dist.is_main:  # equal on all ranks: counted once
            finite = torch.isfinite(norm)
            sums[-3] += torch.where(finite, norm, 0.0)
            sums[-2] += finite
        sums[-1] += count
        step += 1
        timer.done(step)
        done += 1
    if clock is not None:
        clock.stop()
    *totals, count = all_reduce_sum(sums, trainer.dist).tolist()
    if stop is not None:
        stop.stopped(done, [*totals, count])
    elapsed = time.perf_counter() - start
    metrics = {f"train_{k}": v for k, v in objective.metrics(totals[: objective.sums_size]).items()}
    metrics |= {"samples_per_s": count / max(elapsed, 1e-9), "lr": lr}
    if norms:
        metrics["grad_norm"] = totals[-2] / max(totals[-1], 1.0)
    return metrics, step


@torch.no_grad()
def evaluate_split(
    model: nn.Module,
    data: Split,
    batch_size: int,
    policy: PrecisionPolicy,
    dist: DistContext,
    objective: Objective,
    cuda_graphs: bool = False,
    heartbeat: Heartbeat | None = None,
    pipeline: "PipelineStep | None" = None,
) -> dict[str, float]:
    """The objective's metrics of `model` on all of `data`, each rank taking a share.

    Runs the unwrapped module: ranks may hold different batch counts here, and a DDP forward
    would wait for its peers. A sharded (FSDP) model has no unwrapped module, and each of its
    forward passes gathers weights from every rank: ranks with fewer batches run one-sample
    padding passes, not counted, until all ranks have run as many. `heartbeat` is told of
    every batch done. `pipeline`: `model` is this rank's stage, and each batch passes through
    the pipeline's stages (the last one's outputs counted).
    """
    sharded = is_sharded(model)
    net = model if sharded else unwrap(model)
    net.eval()
    sums = torch.zeros(objective.sums_size, dtype=torch.float64, device=dist.device)
    batches = eval_batches(data, batch_size, dist.dp_rank, dist.dp_size)
    counted = len(batches)
    if sharded:
        batches += _padding(batches, data, dist)
    beat = heartbeat.beat if heartbeat is not None else lambda phase: None
    beat("evaluation")
    for index, (x, y) in enumerate(data.batches(batches, dist.device)):
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with policy.autocast():
            output = logits_of(net(x)) if pipeline is None else pipeline.forward(x)
        if index < counted and output is not None:
            sums += objective.sums(output, y)
        beat("evaluation")
    return objective.metrics(all_reduce_sum(sums, dist).tolist())


def _padding(batches: list[torch.Tensor], data: Split, ctx: DistContext) -> list[torch.Tensor]:
    """One-sample batches that bring this rank's count of `batches` up to the most any rank has."""
    count = torch.tensor([len(batches)], device=ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    first = torch.zeros(1, dtype=torch.int64, device=data.device)
    return [first] * (int(count.item()) - len(batches))
