"""A job module whose import is hit by the preemption signal once, as on a loaded Slurm node
where the requeue signal arrives while the ranks still import torch (test payload)."""

import os
from pathlib import Path

import submitit

import trainflow.tasks.train  # noqa: F401  (what unpickling a training job imports first)
from trainflow.tasks.train.limits.early_signal import (
    deliver_held_signal,
    in_submitit_task,
    preemption_signal,
)

_MARK = Path(os.environ.get("TRAINFLOW_TEST_MARK", "/nonexistent/mark"))

if in_submitit_task() and _MARK.parent.is_dir() and not _MARK.exists():
    _MARK.write_text("signalled during import\n")
    os.kill(os.getpid(), preemption_signal())


class Job(submitit.helpers.Checkpointable):
    """Returns which attempt finished; requeued (default checkpoint) when signalled."""

    def __call__(self) -> str:
        deliver_held_signal()
        return f"finished after {_MARK.read_text().strip()}"
