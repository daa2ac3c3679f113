"""A training job whose chosen rank is slowed on purpose: a sleep in its data path (each batch
of the training split arrives late) or in its model's forward pass (slow compute). The other
ranks run as usual: under DDP they wait for it in the gradient all-reduce."""

import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import cloudpickle
import torch

from trainflow.tasks.train.data import SplitData as Split
from trainflow.tasks.train.distributed import DistContext
from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.loop import Trainer
from trainflow.tasks.train.precision import PrecisionPolicy
from trainflow.tasks.train.prefetch import Batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LateBatches:
    """A split whose every batch arrives `delay_s` late (a slow read)."""

    def __init__(self, split: Split, delay_s: float) -> None:
        self._split, self._delay_s = split, delay_s

    def __len__(self) -> int:
        return len(self._split)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._split, name)

    def batches(self, indices: Sequence[torch.Tensor], device: torch.device) -> Iterator[Batch]:
        for batch in self._split.batches(indices, device):
            time.sleep(self._delay_s)
            yield batch


class SlowRankJob(TrainingJob):
    """Rank `rank` sleeps `delay_s` a step in its data path (`where="data"`: every training
    batch arrives late) or in its model's training forward pass (`where="compute"`)."""

    def __init__(
        self,
        spec: TrainJobSpec,
        rank: int,
        where: Literal["data", "compute"],
        delay_s: float,
    ) -> None:
        super().__init__(spec)
        self.rank, self.where, self.delay_s = rank, where, delay_s

    def _load(self, split: Literal["train", "val"], dist: DistContext, nhwc: bool) -> Split:
        data = super()._load(split, dist, nhwc)
        if split == "train" and self.where == "data" and dist.rank == self.rank:
            return LateBatches(data, self.delay_s)
        return data

    def _trainer(
        self, built: torch.nn.Module, dist: DistContext, policy: PrecisionPolicy, *args: Any
    ) -> Trainer:
        trainer = super()._trainer(built, dist, policy, *args)
        if self.where == "compute" and dist.rank == self.rank:

            def hook(module: torch.nn.Module, args: object) -> None:
                if module.training:
                    time.sleep(self.delay_s)

            built.register_forward_pre_hook(hook)
        return trainer
