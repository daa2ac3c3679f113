"""A training job whose chosen rank stops making progress in the forward pass of a chosen step,
once: the first attempt hangs there (a user's code that never returns), the restarted one
trains through.

The hang is a forward pre-hook on the model (not part of its weights), so the restarted job's
weights equal an uninterrupted run's."""

import os
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.precision import PrecisionPolicy

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def never_returns(marker: Path, how: str = "sleep") -> None:
    """Where the hung rank is stuck: sleeping in a loop, spinning (a busy loop), or blocked in
    a read that never gets data."""
    marker.touch()
    if how == "read":
        readable, _writable = os.pipe()  # its write end stays open: the read waits forever
        os.read(readable, 1)
    while how == "spin":
        pass
    while True:
        time.sleep(0.05)


class HangingJob(TrainingJob):
    """Rank `rank` hangs (`how`: never_returns) at training forward pass number `at_step` of
    its first attempt (the one that finds no `marker` file)."""

    def __init__(
        self, spec: TrainJobSpec, rank: int, at_step: int, marker: Path, how: str = "sleep"
    ) -> None:
        super().__init__(spec)
        self.rank, self.at_step, self.marker, self.how = rank, at_step, marker, how

    def _trainer(
        self, built: torch.nn.Module, dist: DistContext, policy: PrecisionPolicy, *args: Any
    ) -> Trainer:
        trainer = super()._trainer(built, dist, policy, *args)
        if dist.rank == self.rank and not self.marker.exists():
            forwards = [0]

            def hook(module: torch.nn.Module, args: object) -> None:
                if module.training:
                    forwards[0] += 1
                    if forwards[0] == self.at_step:
                        never_returns(self.marker, self.how)

            built.register_forward_pre_hook(hook)
        return trainer
