"""A sweep's outcome: which element of its job array won."""

from typing import Any

from trainflow.tasks.train.ref import CheckpointRef


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
