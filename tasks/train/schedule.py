"""The learning-rate schedule: a pure function of the optimizer step.

A resumed run computes its learning rate from the step it resumes at, so a checkpoint holds
no scheduler state. The shapes follow Hugging Face transformers' schedules of the same names
(`get_cosine_schedule_with_warmup`, `get_linear_schedule_with_warmup`,
`get_constant_schedule_with_warmup`, `get_wsd_schedule` with a linear decay): a linear
warm-up from 0 to the peak over the warm-up steps (step 0 runs at 0), then the shape, which
ends at `min_lr_ratio` x the peak.
"""

import math
from dataclasses import dataclass
from typing import Literal

from trainflow.errors import ConfigError
from trainflow.tasks.train.config import TrainConfig

ScheduleKind = Literal["cosine", "linear", "constant", "wsd"]
WSD_DECAY_FRACTION = 0.1
"""train.decay_fraction when unset under schedule=wsd: the last 10% of the steps decay."""


@dataclass(frozen=True)
class Schedule:
    """A schedule's shape, its step counts resolved for one run."""

    kind: ScheduleKind = "cosine"
    """cosine, linear, constant or wsd (warm-up, stable, decay)."""
    warmup_steps: int = 0
    """Steps of the linear warm-up from 0 to the peak."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a fraction of the peak."""
    decay_steps: int = 0
    """wsd: steps of the final linear decay (the stable phase is what is left)."""

    def lr(self, step: int, total_steps: int, peak_lr: float) -> float:
        """The learning rate of optimizer step `step` (0-based) of a run of `total_steps`."""
        if step < self.warmup_steps:
            return peak_lr * step / self.warmup_steps
        floor = peak_lr * self.min_lr_ratio
        if self.kind == "constant":
            return peak_lr
        if self.kind == "wsd":
            decay_start = total_steps - self.decay_steps
            if step < decay_start:
                return peak_lr
            progress = min((step - decay_start) / max(self.decay_steps, 1), 1.0)
            return floor + (peak_lr - floor) * (1.0 - progress)
        progress = min((step - self.warmup_steps) / max(total_steps - self.warmup_steps, 1), 1.0)
        if self.kind == "linear":
            return floor + (peak_lr - floor) * (1.0 - progress)
        # with no warm-up and no floor: 0.5 * peak * (1 + cos(pi * step / total)), bit for bit
        return floor + 0.5 * (peak_lr - floor) * (1.0 + math.cos(math.pi * progress))


def schedule_for(cfg: TrainConfig, total_steps: int) -> Schedule:
    """The schedule train.schedule and its keys describe, over a run of `total_steps` optimizer
    steps; ConfigError in one line when its warm-up and decay do not fit in the run."""
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_fraction * total_steps)
    decay = 0
    if cfg.schedule == "wsd":
        fraction = WSD_DECAY_FRACTION if cfg.decay_fraction is None else cfg.decay_fraction
        decay = max(math.ceil(fraction * total_steps), 1)
    if warmup + decay > total_steps:
        key = "train.warmup_steps" if cfg.warmup_steps else "train.warmup_fraction"
        parts = f"{warmup} warm-up" + (f" + {decay} decay" if decay else "")
        raise ConfigError(
            f"{key}: the schedule's {parts} steps exceed the run's {total_steps} optimizer "
            f"steps: lower {key} (or train.decay_fraction), or train for longer"
        )
    return Schedule(cfg.schedule, warmup, cfg.min_lr_ratio, decay)
