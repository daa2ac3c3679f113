"""A single-process training set-up on MNIST-shaped data, for step-level benchmarks.

Step time does not depend on what the pixels are, so the data is random: these benchmarks
need the real model, optimiser, precision policy and loop, not the real dataset.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from trainflow.tasks.objectives.classification import Classification
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.data import Split, rank_batches
from trainflow.tasks.train.distributed import distributed
from trainflow.tasks.train.loop import Trainer, train_epoch
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.optimizers import make_optimizer
from trainflow.tasks.train.precision import resolve_precision
from trainflow.tasks.train.step_metrics import Window


@contextmanager
def trainer_for(cfg: TrainConfig, samples: int = 4096) -> Iterator[tuple[Trainer, Split]]:
    """A world-of-one Trainer for `cfg` on random 1x28x28 data with 10 classes."""
    with distributed("auto") as dist:
        model = build_model(cfg, image_classification((1, 28, 28), 10)).to(dist.device)
        trainer = Trainer(
            model,
            make_optimizer(cfg, model),
            resolve_precision(cfg.precision, dist.device).make_scaler(),
            resolve_precision(cfg.precision, dist.device),
            dist,
            Classification(image_classification((1, 28, 28), 10)),
            cfg.lr,
            10**9,
        )
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(samples, 1, 28, 28, generator=gen).to(dist.device)
        y = torch.randint(0, 10, (samples,), generator=gen).to(dist.device)
        yield trainer, Split(x, y)


@dataclass
class _Sums:
    """An EpochStop that never stops and keeps the loop's all-rank sums."""

    carried: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)

    def should_stop(self, step: int) -> bool:
        return False

    def stopped(self, done: int, totals: list[float]) -> None:
        self.totals = totals


def timed_epochs(
    trainer: Trainer,
    data: Split,
    cfg: TrainConfig,
    epochs: int,
    after: Callable[..., None],
    every: int = 0,
    each: Callable[[dict[str, float], int], None] | None = None,
) -> list[float]:
    """Seconds per step of each epoch, `after(metrics, epoch)` included in the timing; with
    `every`, the epoch runs in segments of that many steps, as train.log_every_steps makes the
    job do, and `each(window metrics, step)` is told of each (tasks.train.step_metrics)."""
    per_step, step = [], 0
    for epoch in range(1, epochs + 1):
        batches = rank_batches(data, cfg.batch_size, cfg.seed, epoch, 0, 1)
        start = time.perf_counter()
        if not every:
            metrics, step = train_epoch(trainer, data, batches, step)
        for first in range(0, len(batches), every or len(batches)) if every else ():
            sums, began = _Sums(), time.perf_counter()
            part = batches[first : first + every]
            metrics, step = train_epoch(trainer, data, part, step, None, sums)
            window = Window()
            window.add(sums.totals, [], time.perf_counter() - began)
            if each is not None:
                each(window.take(trainer.objective, False, metrics["lr"]), step)
        after(metrics, epoch)
        per_step.append((time.perf_counter() - start) / len(batches))
    return per_step
