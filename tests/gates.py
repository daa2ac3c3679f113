"""A training job that waits at chosen epochs until the test opens a gate (creates a file).

Tests that act on a running job (stop a server, requeue it) hold it at an epoch this way, so
what they check does not depend on how fast this machine trains at the time."""

import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import cloudpickle

from trainflow.tasks.train.cadence import Due
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.recipe import Recipe

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class GatedJob(TrainingJob):
    """Waits before the epochs named in `gates` until the test creates the gate's file."""

    def __init__(self, spec: TrainJobSpec, gates: dict[int, Path]) -> None:
        super().__init__(spec)
        self.gates = gates

    def __call__(self) -> Any:
        self.recipe = type("Gated", (_GatedRecipe,), {"gates": self.gates})
        return super().__call__()


class _GatedRecipe(Recipe):
    gates: ClassVar[dict[int, Path]] = {}

    def segment(self) -> tuple[dict[str, float], Due]:
        gate = self.gates.get(self.progress.epoch + 1)
        while gate is not None and not gate.exists():
            time.sleep(0.05)
        return super().segment()
