"""P5: blocking checkpoint save time over one training step time (goal <= 1).

The save is the one the training job makes every epoch: the full resumable state (model,
optimizer, scaler, RNG, progress) written atomically with fsync. Measured for the reference
CNN and for the residual net, next to the step time of the same model.
"""

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.steps import timed_epochs, trainer_for
from trainflow.tasks.train.checkpointing.checkpoint import save_checkpoint, training_state
from trainflow.tasks.train.config import TrainConfig

SAVES = 9


def _measure(cfg: TrainConfig, folder: Path) -> dict[str, float]:
    with trainer_for(cfg, samples=2048) as (trainer, data):
        step_s = statistics.median(timed_epochs(trainer, data, cfg, 3, lambda *_: None)[1:])
        times = []
        for epoch in range(1, SAVES + 1):
            start = time.perf_counter()
            state = training_state(
                trainer.model, trainer.optimizer, trainer.scaler, {"epoch": epoch, "step": 0}
            )
            path = save_checkpoint(state, folder)
            times.append(time.perf_counter() - start)
        save_s = statistics.median(times)
        return {
            "save_s": save_s,
            "step_s": step_s,
            "ratio": save_s / step_s,
            "bytes": path.stat().st_size,
        }


def run() -> tuple[str, list[tuple[str, str, str]], dict[str, Any]]:
    """Checkpoint cost in steps, per model."""
    rows, result = [], {}
    for name, cfg in (
        ("reference_cnn", TrainConfig()),
        ("resnet w32", TrainConfig(model="resnet", width=32)),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            m = _measure(cfg, Path(tmp))
        result[name] = m
        rows.append((f"save / step ({name})", f"{m['ratio']:.2f}", "<= 1"))
        rows.append(
            (
                f"  save ms / step ms / MB ({name})",
                f"{m['save_s'] * 1e3:.1f}/{m['step_s'] * 1e3:.1f}/{m['bytes'] / 1e6:.2f}",
                "",
            )
        )
    return "P5 checkpoint overhead (median blocking save vs median step)", rows, result
