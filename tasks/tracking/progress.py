"""The training's progress as a Prefect progress artifact, updated each epoch.

The flow side learns how far a job got from what the job already writes for resuming: one
checkpoint per epoch, renamed into place (``epoch-NNNNNN.pt``), on the filesystem that the
flow and the ranks share. The check runs whenever the job's log lines are forwarded (rank 0
prints a line per epoch right after its checkpoint), so no extra thread or poll is needed. A
resumed job starts from the epoch it reached. A Prefect API error never fails the training:
it is said once and progress stops being updated.
"""

from collections.abc import Callable
from pathlib import Path
from typing import cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from trainflow.tasks.train.checkpoint import checkpoints

TRAIN_KEY = "train-progress"
"""Key of the train stage's progress artifact (Prefect: lowercase letters, digits, dashes)."""


class EpochProgress:
    """A progress artifact showing the share of a run's epochs that are checkpointed."""

    def __init__(
        self, checkpoint_dir: Path, epochs: int, warn: Callable[[str], None], key: str = TRAIN_KEY
    ) -> None:
        self._dir, self._epochs, self._warn = checkpoint_dir, epochs, warn
        self._epoch = self._done()
        self._id: UUID | None = None
        try:
            created = create_progress_artifact(
                self.percent, key=key, description=self._description()
            )
            self._id = cast(UUID, created)  # typed as sync-or-async; called sync, it is the id
        except Exception as exc:
            self._give_up(exc)

    @property
    def percent(self) -> float:
        """Share of the epochs done, 0 to 100."""
        return 100.0 * min(self._epoch, self._epochs) / self._epochs

    def watching(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, then an update of the artifact when another epoch is checkpointed."""

        def log_and_observe(line: str) -> None:
            log(line)
            self.observe()

        return log_and_observe

    def observe(self) -> None:
        """Update the artifact if the newest checkpoint is of a later epoch than shown."""
        done = self._done()
        if done > self._epoch:
            self._epoch = done
            self._update()

    def finish(self) -> None:
        """Show the run as complete (every epoch trained)."""
        self._epoch = self._epochs
        self._update()

    def _done(self) -> int:
        newest = checkpoints(self._dir)
        return int(newest[0].stem.split("-")[1]) if newest else 0

    def _description(self) -> str:
        return f"training: epoch {self._epoch} of {self._epochs} checkpointed"

    def _update(self) -> None:
        if self._id is None:
            return
        try:
            update_progress_artifact(self._id, self.percent, description=self._description())
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        self._id = None
        self._warn(f"training progress not shown in Prefect: {type(exc).__name__}: {exc}"[:400])
