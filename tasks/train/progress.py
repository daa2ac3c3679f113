"""A run's progress (saved in every checkpoint) and what a checkpoint must share with the job
that resumes it."""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainflow.errors import ConfigError
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.logged_through import handed_through
from trainflow.tasks.tracking.logger import MetricLogger
from trainflow.tasks.tracking.packages import package_lock_hash
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.ref import CheckpointRef

NOT_LOGGED = ("epoch", "step", "epoch_batches")
"""History entry keys that say where a validation ran, not what it measured (epoch_batches:
steps into the next epoch, for one that ran inside an epoch)."""
# A run may resume with more epochs or steps, another logging or checkpoint cadence, other
# checkpoint retention or early stopping (its count is kept), on another device, precision or
# speed setting (memory format, compilation, data placement, DDP buckets, FSDP's resharding
# and activation checkpointing) or hang allowances; nothing else may change. Not cuda_graphs:
# it drops each epoch's last partial batch, so it changes which batches a run takes. Not
# strategy: the checkpoints' layouts differ.
MAY_CHANGE_ON_RESUME = {
    "epochs",
    "max_steps",
    "log_every_steps",
    "checkpoint_every_steps",
    "hang_timeout_s",
    "hang_first_step_s",
    "straggler_fraction",
    "straggler_windows",
    "straggler_window_steps",
    "time_limit_margin_s",
    "log_every_epochs",
    "device",
    "precision",
    "channels_last",
    "compile",
    "data_placement",
    "ddp_bucket_cap_mb",
    "reshard_after_forward",
    "parallel",
    "activation_checkpointing",
    "test_after_training",
    "keep_checkpoints",
    "early_stop_patience",
    "early_stop_min_delta",
}


OLD_WIDTH_DEFAULT = 32
"""train.width's default before model plug-ins (now None: the resnet factory's own 32)."""


@dataclass
class Progress:
    """How far the run got: saved in every checkpoint, restored on resume."""

    data_seed: int
    epoch: int = 0
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float = -1.0
    """The monitored metric (train.monitor) of the best epoch so far (tasks.train.monitor)."""
    best_epoch: int = 0
    """The best validation's place in `history`, from 1 (its epoch on a run validated once
    per epoch); 0: none yet."""
    stale_validations: int = 0
    """Validations in a row since the monitor last improved by more than
    train.early_stop_min_delta (early stopping counts these)."""
    improved_from: float | None = None
    """The monitor's value at that last improvement (None: no validation yet)."""
    logged_epochs: int = 0
    """Entries of `history` whose metrics reached the logger's flush: later ones are re-logged
    on resume."""
    data_world: int = 0
    """Ranks the run started on: its global batch is train.batch_size x data_world, kept when
    it resumes on fewer (tasks.train.resume). 0: not recorded (checkpoints written before)."""
    epoch_batches: int = 0
    """Steps of epoch `epoch + 1` done: a checkpoint inside an epoch (train.max_steps, a step
    cadence, a time limit; a step is one batch per rank, or `accumulation` micro-batches on a
    run kept to its global batch)."""
    epoch_sums: list[float] = field(default_factory=list)
    """Those batches' training metric sums, all ranks together (the loop's, count last)."""
    timing: dict[str, float] = field(default_factory=dict)
    """What the time-limit watch measured (tasks.train.limits.time_limit.Estimates)."""
    by_step: bool = False
    """The run's metrics use the global step as their x axis, else the epoch: set when the run
    starts (train.counts_steps then) and kept, so a resume that adds a step key does not mix
    the two axes in one MLflow run."""

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Progress":
        """The progress fields of a checkpoint's state (other keys ignored)."""
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in state.items() if k in fields})


def run_identity(train: TrainConfig, dataset_hash: str) -> dict[str, Any]:
    """What a checkpoint must share with a job to be resumed by it."""
    cfg = train.model_dump(mode="json", exclude=MAY_CHANGE_ON_RESUME)
    return {"dataset_hash": dataset_hash, **cfg}


def check_same_run(current: dict[str, Any], saved: dict[str, Any], path: Path) -> None:
    """ConfigError when the checkpoint at `path` (identity `saved`) belongs to a different run
    than `current` (run_identity of this job)."""
    # A field added after the checkpoint was written counts as having its default.
    defaults = TrainConfig().model_dump(mode="json", exclude=MAY_CHANGE_ON_RESUME)
    raw, saved = saved, {**defaults, **saved}
    if saved.get("width") == OLD_WIDTH_DEFAULT and current.get("width") is None:
        saved["width"] = None  # written before model plug-ins: the same network
    if "weight_decay_all" not in raw:  # written when every parameter decayed (one group)
        saved["weight_decay_all"] = True
    changed = sorted(k for k in current.keys() | saved.keys() if current.get(k) != saved.get(k))
    if changed:
        raise ConfigError(
            f"{path} was written by a run with other settings ({', '.join(changed)}): "
            f"start a new run (it trains in a folder of its own), or delete {path.parent} to "
            "start this run from scratch"
        )


def metric_x(progress: Progress, entry: dict[str, float]) -> int:
    """The x axis value of a history entry's metrics: its global step or its epoch
    (Progress.by_step)."""
    return int(entry["step"] if progress.by_step else entry["epoch"])


def relog(progress: Progress, logger: MetricLogger, out_dir: Path) -> None:
    """Log the validations a previous attempt checkpointed but never handed to its logger (no
    gaps, no repeats): an attempt whose logger closed cleanly sent or kept all it was given."""
    handed = handed_through(out_dir)
    for entry in progress.history[progress.logged_epochs :]:
        x = metric_x(progress, entry)
        if x > handed:
            metrics = {k: v for k, v in entry.items() if k not in NOT_LOGGED}
            logger.log(metrics, step=x)


def best_meta(train: TrainConfig, ref: DatasetRef, progress: Progress) -> dict[str, Any]:
    """What evaluation needs next to the best weights: how to rebuild the model, and when."""
    return {
        "epoch": progress.epoch,
        "step": progress.step,
        "metrics": {k: v for k, v in progress.history[-1].items() if k != "epoch_batches"},
        "train": train.model_dump(mode="json"),
        "shape": list(ref.shape),
        "num_classes": ref.n_classes,
        "dataset_hash": ref.content_hash,
    }


def finish_run(
    out_dir: Path, progress: Progress, test_metrics: dict[str, float] | None = None
) -> CheckpointRef:
    """Write history.json into out_dir and describe its best.pt (rank 0, at the end);
    `test_metrics`: the job's test pass of it (tasks.train.first_result), if any."""
    history_path = out_dir / "history.json"
    tmp = history_path.with_name(f"history.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(progress.history, indent=1))
    os.replace(tmp, history_path)
    best = out_dir / "best.pt"
    entry = progress.history[progress.best_epoch - 1]
    return CheckpointRef(
        path=best,
        sha256=sha256_file(best),
        epoch=int(entry["epoch"]),
        step=int(entry["step"]),
        metrics={k: v for k, v in entry.items() if k.startswith("val_")},
        history_path=history_path,
        package_lock_hash=package_lock_hash(),
        test_metrics=test_metrics or {},
    )
