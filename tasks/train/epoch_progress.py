"""Training's progress as a Prefect progress artifact: the share of the epochs checkpointed.

The flow side learns how far a job got from what the job already writes for resuming: one
checkpoint per epoch, renamed into place (``epoch-NNNNNN.pt``), on the filesystem that the
flow and the ranks share. The check runs whenever the job's log lines are forwarded (rank 0
prints a line per epoch right after its checkpoint), so no extra thread or poll is needed. A
resumed job starts from the epoch it reached. A Prefect API error never fails the training:
it is said once and progress stops being updated (tasks.prefect_progress).
"""

from collections.abc import Callable
from pathlib import Path

from trainflow.tasks.prefect_progress import TRAIN_KEY, ProgressArtifact
from trainflow.tasks.train.checkpointing.checkpoint import checkpoint_epoch, checkpoints


class EpochProgress(ProgressArtifact):
    """A progress artifact showing the share of a run's epochs that are checkpointed."""

    def __init__(
        self,
        checkpoint_dir: Path,
        epochs: int | None,
        warn: Callable[[str], None],
        key: str = TRAIN_KEY,
    ) -> None:
        """`epochs`: the run's (None: counted in train.max_steps alone, its epochs unknown
        here; the artifact then shows the epochs checkpointed, and 100% at the end)."""
        self._dir, self._epochs, self._finished = checkpoint_dir, epochs, False
        self._epoch = self._done()
        super().__init__(key, "training", warn)

    @property
    def percent(self) -> float:
        """Share of the epochs done, 0 to 100."""
        if self._epochs is None:
            return 100.0 if self._finished else 0.0
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
        self._finished = True
        self._epoch = self._epochs if self._epochs is not None else self._done()
        self._update()

    def _done(self) -> int:
        newest = checkpoints(self._dir)
        return checkpoint_epoch(newest[0]) if newest else 0

    def _description(self) -> str:
        of = f" of {self._epochs}" if self._epochs is not None else ""
        return f"training: epoch {self._epoch}{of} checkpointed"
