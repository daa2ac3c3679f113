"""Per-step metrics (train.log_every_steps) and the progress line's position and ETA.

The loop sums the objective's metrics on the device and reads them once per segment
(tasks.train.loop.train_epoch, tasks.train.cadence): the window of steps since the last log
adds up the differences of those reads, so logging every N steps costs one small all-reduce
per N steps and no host sync per step.
"""

import time
from dataclasses import dataclass, field

from trainflow.tasks.objectives import Objective
from trainflow.tasks.train.cadence import Due, RunPlan
from trainflow.tasks.train.limits.time_limit import time_text

STEP_SUFFIX = "_step"
"""Per-step metrics are named as the epoch's with this suffix (train_loss_step, lr_step):
they are another aggregate of the same values, on the global step's axis."""


@dataclass
class Window:
    """The loop's all-rank sums over the steps since the last per-step log, across segments
    and epochs (the objective's sums, with clipping the norm sum and the finite steps, the
    sample count last), and the seconds the loop took for them."""

    sums: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, totals: list[float], before: list[float], seconds: float) -> None:
        """A segment that took the loop's sums from `before` (empty at an epoch's start) to
        `totals` in `seconds`."""
        start = before or [0.0] * len(totals)
        done = [t - b for t, b in zip(totals, start, strict=True)]
        self.sums = [a + d for a, d in zip(self.sums, done, strict=True)] if self.sums else done
        self.seconds += seconds

    def take(self, objective: Objective, clipped: bool, lr: float) -> dict[str, float]:
        """The window's metrics, and a new window: train_<metric>_step, lr_step (`lr`, the
        last step's), grad_norm_step (with clipping) and samples_per_s_step."""
        sums, count = self.sums[: objective.sums_size], self.sums[-1]
        metrics = {f"train_{k}": v for k, v in objective.metrics(sums).items()}
        metrics |= {"lr": lr, "samples_per_s": count / max(self.seconds, 1e-9)}
        if clipped:
            metrics["grad_norm"] = self.sums[-3] / max(self.sums[-2], 1.0)
        self.sums, self.seconds = [], 0.0
        return {k + STEP_SUFFIX: v for k, v in metrics.items()}


@dataclass
class Position:
    """Where the run is, for the progress line: the plan, and when this attempt started."""

    plan: RunPlan
    by_step: bool
    """Say the step and an ETA (a run counted in steps: Progress.by_step), else the epoch."""
    first_step: int = 0
    started: float = field(default_factory=time.monotonic)

    def start(self, step: int) -> None:
        """Training starts (or resumes) at `step` now."""
        self.first_step, self.started = step, time.monotonic()

    def line(self, epoch: int, step: int, due: Due) -> str:
        """`epoch 2/8` at an epoch's end of a run counted in epochs; with steps `step
        120/400 (epoch 2/3) eta 1m05s`."""
        epochs = self.plan.epochs
        if not self.by_step:
            return f"epoch {epoch}/{epochs}"
        into = epoch if due.epoch_end else min(epoch + 1, epochs)
        total = self.plan.total_steps
        text = f"step {step}/{total} (epoch {into}/{epochs})"
        done = step - self.first_step
        if done > 0 and step < total:
            eta = (time.monotonic() - self.started) / done * (total - step)
            text += f" eta {time_text(eta)}"
        return text
