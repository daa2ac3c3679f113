"""A sweep's training: one job array, each element a full TrainingJob with its own spec."""

from typing import Any

import submitit

from trainflow.tasks.train.job import TrainingJob, TrainJobSpec
from trainflow.tasks.train.ref import CheckpointRef


class ArrayTrainingJob(submitit.helpers.Checkpointable):
    """The job array's callable: element i trains spec i.

    Checkpointable's default checkpoint() resubmits the same call, and TrainingJob resumes
    from the element's own out_dir, so a requeued element continues where it stopped.
    """

    def __call__(self, spec: TrainJobSpec) -> CheckpointRef | None:
        """Train one element of the sweep."""
        return TrainingJob(spec)()


def best_element(
    outcomes: list[Any], metric: str = "val_accuracy", higher_is_better: bool = True
) -> int:
    """Index of the completed element with the best validation metric (first on ties)."""
    sign = 1.0 if higher_is_better else -1.0
    scored = [
        (sign * o.metrics[metric] if metric in o.metrics else float("-inf"), -i)
        for i, o in enumerate(outcomes)
        if isinstance(o, CheckpointRef)
    ]
    if not scored:
        raise ValueError("no sweep element completed")
    return -max(scored)[1]
