"""The best model and when to stop: train.monitor, keep_checkpoints, early_stop_patience.

Pure parts, told of one validation at a time (its metrics, the epoch and step it ran after):
which validation is the best so far (best.pt, what evaluate takes), whether the run has
stopped improving (early stopping), and which checkpoints a folder keeps (the k best by the
monitor plus the newest). The training job calls `Monitor.observe` once after each
validation, on every rank (the validation metrics are all-reduced: equal on all ranks, so
every rank takes the same decision without a collective); its state lives in the run's
Progress, so a requeued or resumed run keeps counting.

A search's pruner and early stopping ask after the same validation, the pruner first: a
pruned trial ends PRUNED; a trial that early stopping ends is COMPLETE, with the value of its
best validation by the monitor (tasks.search.trial_worker).
"""

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainflow.errors import ConfigError
from trainflow.tasks.objectives import Objective
from trainflow.tasks.train.checkpointing.checkpoint import newest_kept
from trainflow.tasks.train.config import TrainConfig

_CHECKPOINT = re.compile(r"^epoch-(\d{6})(?:\+(\d{6}))?(?:\.pt)?$")
"""Full checkpoint files `epoch-E[+B].pt` and sharded folders `epoch-E[+B]` alike."""


class Tracked(Protocol):
    """What the monitor keeps of a run (tasks.train.progress.Progress holds it)."""

    epoch: int
    history: list[dict[str, float]]
    """One entry per validation (its epoch, step and metrics), the newest last."""
    best_metric: float
    best_epoch: int
    stale_validations: int
    improved_from: float | None
    by_step: bool
    """Whether the run counts steps (its lines then say the step) rather than epochs."""


@dataclass(frozen=True)
class Verdict:
    """What one validation decided."""

    best: bool
    """The best validation so far (best.pt is written from it)."""
    stop: bool
    """The run has stopped improving: train no further."""
    line: str = ""
    """The early stop, said in one line (when `stop`)."""


@dataclass(frozen=True)
class Monitor:
    """A validation metric, its direction, and what follows from it."""

    metric: str
    """As logged: val_loss, val_accuracy, ..."""
    higher: bool
    """Whether higher is better."""
    patience: int = 0
    """Validations in a row without an improvement by more than `min_delta` that stop the
    run; 0: never."""
    min_delta: float = 0.0
    keep: int | None = None
    """Checkpoints kept by their monitor value (plus the newest); None: the KEEP newest."""

    def better(self, value: float, than: float, by: float = 0.0) -> bool:
        """Whether `value` beats `than` by more than `by` (strictly) in this direction."""
        if math.isnan(value):
            return False
        if math.isnan(than):  # anything measured beats a diverged (NaN) value
            return True
        return value - than > by if self.higher else than - value > by

    def observe(
        self, state: Tracked, metrics: dict[str, float], position: int | None = None
    ) -> Verdict:
        """Record the validation of epoch `state.epoch` (its `metrics`; `position`: its place
        in the run's history, from 1, when the run validates inside epochs too; default its
        epoch) into `state`: the best so far (a later one must be strictly better), and the
        validations in a row without an improvement by more than min_delta over the last one
        that had it."""
        value = self.value(metrics)
        best = state.best_epoch == 0 or self.better(value, state.best_metric)
        if best:
            state.best_metric = value
            state.best_epoch = state.epoch if position is None else position
        reference = state.improved_from
        if reference is None or self.better(value, reference, self.min_delta):
            state.improved_from, state.stale_validations = value, 0
        else:
            state.stale_validations += 1
        return Verdict(best, self.stopped(state), self._stop_line(state))

    def stopped(self, state: Tracked) -> bool:
        """Whether `state` says the run has stopped improving (a resumed run that had: no
        more training)."""
        return self.patience > 0 and state.stale_validations >= self.patience

    def _stop_line(self, state: Tracked) -> str:
        if not self.stopped(state):
            return ""
        now, best = f"epoch {state.epoch}", f"epoch {state.best_epoch}"
        if state.by_step and state.history:  # the validations' steps, as the run's lines say
            now = f"step {int(state.history[-1]['step'])}"
            best = f"step {int(state.history[state.best_epoch - 1]['step'])}"
        return (
            f"early stop at {now}: {self.metric} has not improved by more than "
            f"{self.min_delta:g} for {self.patience} validations (best {state.best_metric:.6g} "
            f"at {best})"
        )

    def value(self, metrics: dict[str, float]) -> float:
        """The monitored metric of a validation's `metrics`; ConfigError naming what the
        validation gave when it lacks it."""
        if self.metric not in metrics:
            given = ", ".join(sorted(k for k in metrics if k.startswith("val_")))
            raise ConfigError(
                f"train.monitor={self.metric}: the validation gave no such metric (it gives "
                f"{given}): set train.monitor to one of them"
            )
        return float(metrics[self.metric])

    def retain(self, newest_first: list[Path], history: Sequence[dict[str, Any]]) -> set[str]:
        """The checkpoints of a folder (`newest_first`) to keep, given the run's `history`
        (one entry per validation: its epoch, its steps into the next when it ran inside an
        epoch, and its metrics): the newest, plus the `keep` best by the monitor (one written
        where no validation ran, before a time limit or between train.val_every_steps
        validations, is kept only while it is the newest); without `keep`, the KEEP newest
        (checkpointing.checkpoint.newest_kept). A tasks.train.checkpointing.checkpoint.Retain."""
        if self.keep is None:
            return newest_kept(newest_first, history)
        values = {_place(h): float(h[self.metric]) for h in history if self.metric in h}
        scored = [(p.name, _value_of(p.name, values)) for p in newest_first]
        return top_k(scored, self.keep, self.higher)


def _place(entry: dict[str, Any]) -> tuple[int, int]:
    """A validation's (epochs done, steps into the next), as its checkpoint is named."""
    return int(entry["epoch"]), int(entry.get("epoch_batches", 0))


def _value_of(name: str, values: dict[tuple[int, int], float]) -> float | None:
    """The monitor value of the validation a checkpoint was written at, if one ran there."""
    match = _CHECKPOINT.match(name)
    if match is None:
        return None
    return values.get((int(match.group(1)), int(match.group(2) or 0)))


def top_k(newest_first: list[tuple[str, float | None]], k: int, higher: bool) -> set[str]:
    """The newest entry's name plus the names of the `k` best values (None: not scored; ties:
    the older entry wins, as best.pt's strictly-better rule has it)."""
    scored = [(i, name, v) for i, (name, v) in enumerate(newest_first) if v is not None]
    # older entries have larger indices: among equal values, prefer the larger index
    scored.sort(key=lambda e: ((-e[2] if higher else e[2]), -e[0]))
    kept = {name for _, name, _ in scored[:k]}
    return kept | {newest_first[0][0]} if newest_first else kept


def monitor_for(cfg: TrainConfig, objective: Objective) -> Monitor:
    """train.monitor (default: the objective's val_<select>), its direction (train.monitor_mode,
    or the objective's), early stopping and retention, as configured."""
    metric = cfg.monitor or f"val_{objective.select}"
    if cfg.monitor_mode == "auto":
        higher = objective.higher_is_better(metric)
    else:
        higher = cfg.monitor_mode == "max"
    return Monitor(
        metric, higher, cfg.early_stop_patience, cfg.early_stop_min_delta, cfg.keep_checkpoints
    )


def validation_metrics(objective: Objective) -> list[str]:
    """The metrics a validation gives with this objective, as logged (val_<name>); [] when
    the objective cannot name them without data."""
    for sums in ([0.0] * objective.sums_size, [1.0] * objective.sums_size):
        try:
            return sorted(f"val_{name}" for name in objective.metrics(sums))
        except (ArithmeticError, ValueError):
            continue
    return []


def check_monitor(cfg: TrainConfig, objective: Objective) -> None:
    """ConfigError (one line) when train.monitor names a metric the objective's validation
    does not give (checked before anything is queued)."""
    if cfg.monitor is None:
        return
    available = validation_metrics(objective)
    if available and cfg.monitor not in available:
        raise ConfigError(
            f"train.monitor={cfg.monitor} is not a metric of train.objective="
            f"{cfg.objective}'s validation: set it to one of {', '.join(available)}"
        )
