"""A run's length and cadence in optimizer steps: where the training loop stops to validate,
checkpoint, log or end.

The recipe (tasks.train.job) trains an epoch in segments: each runs up to the next boundary
this plan names (the epoch's end, train.max_steps, or the next step of train.val_every_steps,
checkpoint_every_steps or log_every_steps), then the recipe does what is due there and goes
on with the same epoch from its position (Progress.epoch_batches), as a run resumed from a
mid-epoch checkpoint does. The steps count optimizer steps of the run's own global batch.
"""

from dataclasses import dataclass

from trainflow.tasks.train.config import TrainConfig


@dataclass(frozen=True)
class Due:
    """What is due at a boundary step."""

    epoch_end: bool
    """The epoch's last step is done."""
    final: bool
    """The run's last step is done (train.max_steps or the last epoch's end)."""
    validate: bool
    """Validate here: an epoch's end, the run's end, or train.val_every_steps."""
    checkpoint: bool
    """Checkpoint here: an epoch's end, the run's end, or train.checkpoint_every_steps."""
    log: bool
    """Log the steps since the last log here (train.log_every_steps)."""


EPOCH_END = Due(epoch_end=True, final=False, validate=True, checkpoint=True, log=False)
"""An epoch's end inside the run: validate and checkpoint."""


@dataclass(frozen=True)
class RunPlan:
    """A run's length and cadence, in optimizer steps."""

    steps_per_epoch: int
    """Optimizer steps of one epoch."""
    total_steps: int
    """Optimizer steps of the whole run: train.max_steps, or the epochs' steps, whichever is
    fewer."""
    val_every: int = 0
    """Validate every this many steps as well as at each epoch's end (0: per epoch only)."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps as well as at each epoch's end (0: per epoch only)."""
    log_every: int = 0
    """Log the training metrics every this many steps (0: per epoch only)."""

    @property
    def epochs(self) -> int:
        """Epochs the run takes part of (the last may end early at train.max_steps)."""
        return -(-self.total_steps // self.steps_per_epoch)

    def next_boundary(self, step: int) -> int:
        """The first step after `step` where the loop stops: the end of the epoch `step` is
        in, the run's end, or the next step of a cadence."""
        return self._next(step, (self.val_every, self.checkpoint_every, self.log_every))

    def next_pause(self, step: int) -> int:
        """The first step after `step` where the loop does more than log: the end of the epoch
        `step` is in, the run's end, a validation or a checkpoint (what the time-limit watch
        plans to: the segments up to it pause for a log only, which takes no time worth
        planning for)."""
        return self._next(step, (self.val_every, self.checkpoint_every))

    def _next(self, step: int, cadences: tuple[int, ...]) -> int:
        epoch_end = (step // self.steps_per_epoch + 1) * self.steps_per_epoch
        candidates = [epoch_end, self.total_steps]
        candidates += [(step // every + 1) * every for every in cadences if every]
        return min(candidates)

    def due(self, step: int) -> Due:
        """What is due once `step` steps are done."""
        epoch_end = step % self.steps_per_epoch == 0
        final = step >= self.total_steps
        return Due(
            epoch_end=epoch_end,
            final=final,
            validate=epoch_end or final or _every(step, self.val_every),
            checkpoint=epoch_end or final or _every(step, self.checkpoint_every),
            log=_every(step, self.log_every),
        )


def _every(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def run_plan(cfg: TrainConfig, steps_per_epoch: int) -> RunPlan:
    """The plan of train.epochs / max_steps and the step cadences over epochs of
    `steps_per_epoch` optimizer steps."""
    limits = [n * steps_per_epoch for n in (cfg.epoch_limit,) if n is not None]
    limits += [cfg.max_steps] if cfg.max_steps is not None else []
    return RunPlan(
        steps_per_epoch=steps_per_epoch,
        total_steps=min(limits),
        val_every=cfg.val_every_steps or 0,
        checkpoint_every=cfg.checkpoint_every_steps or 0,
        log_every=cfg.log_every_steps or 0,
    )
