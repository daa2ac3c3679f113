"""A training job whose every step takes at least a set time: a sleep at the step's start,
which changes no number it computes.

Time-limit tests need training that outlasts a limit on a fast machine and a loaded one alike;
with a floor under each step, how many limits a job meets depends little on the machine."""

import sys
import time
from dataclasses import replace
from typing import Any

import cloudpickle

from trainflow.cluster.heartbeat import Heartbeat
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.loop import Trainer

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _SleepyBeat(Heartbeat):
    """Sleeps `sleep_s` at every step's start, then beats the job's own heartbeat."""

    def __init__(self, inner: Heartbeat, sleep_s: float) -> None:
        super().__init__(None, 0.0, 0.0)
        self.inner, self.sleep_s = inner, sleep_s

    def beat(self, phase: str, step: int | None = None) -> None:
        if phase == "step":
            time.sleep(self.sleep_s)
        self.inner.beat(phase, step)


class SlowSteps(TrainingJob):
    """TrainingJob with `sleep_s` added to every training step."""

    def __init__(self, spec: TrainJobSpec, sleep_s: float) -> None:
        super().__init__(spec)
        self.sleep_s = sleep_s

    def _trainer(self, *args: Any, **kwargs: Any) -> Trainer:
        trainer = super()._trainer(*args, **kwargs)
        return replace(trainer, heartbeat=_SleepyBeat(trainer.heartbeat, self.sleep_s))
