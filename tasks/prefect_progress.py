"""Progress of the long stages as Prefect progress artifacts: preprocessing, by shard-writing
tasks done, a search, by trials ended, and the base of training's (tasks.train.epoch_progress).

Prefect's, not MLflow's: the stages' Prefect @task entries create them, the plain stage code
never does. A Prefect API error never fails the stage: it is said once and progress stops
being updated.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

TRAIN_KEY = "train-progress"
"""Key of the train stage's progress artifact (Prefect: lowercase letters, digits, dashes)."""
PREPROCESS_KEY = "preprocess-progress"
"""Key of the preprocess stage's progress artifact."""
SEARCH_KEY = "search-progress"
"""Key of a search's progress artifact (tasks.search)."""


class ProgressArtifact(ABC):
    """One progress artifact; a Prefect API error is said once and ends the updates.
    Subclasses set what `percent` reads before calling this constructor."""

    def __init__(self, key: str, what: str, warn: Callable[[str], None]) -> None:
        self._what, self._warn = what, warn
        self._id: UUID | None = None
        try:
            created = create_progress_artifact(
                self.percent, key=key, description=self._description()
            )
            self._id = cast(UUID, created)  # typed as sync-or-async; called sync, it is the id
        except Exception as exc:
            self._give_up(exc)

    @property
    @abstractmethod
    def percent(self) -> float:
        """Share done, 0 to 100."""

    @abstractmethod
    def _description(self) -> str: ...

    def _update(self) -> None:
        if self._id is None:
            return
        try:
            update_progress_artifact(self._id, self.percent, description=self._description())
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        self._id = None
        self._warn(f"{self._what} progress not shown in Prefect: {type(exc).__name__}: {exc}"[:400])


class TaskProgress(ProgressArtifact):
    """The share of a stage's dask tasks done (preprocessing: the shard-writing tasks), updated
    at most every `step` percent: each update costs the Prefect server a write."""

    def __init__(self, warn: Callable[[str], None], step: float = 5.0) -> None:
        self._finished, self._total, self._step, self._shown = 0, 0, step, 0.0
        super().__init__(PREPROCESS_KEY, "preprocessing", warn)

    @property
    def percent(self) -> float:
        """Share of the tasks done, 0 to 100 (0 until the tasks are known)."""
        return 100.0 * self._finished / self._total if self._total else 0.0

    def __call__(self, done: int, total: int) -> None:
        """`done` of `total` tasks have finished."""
        self._finished, self._total = done, total
        if self.percent - self._shown >= self._step or done == total:
            self._shown = self.percent
            self._update()

    def _description(self) -> str:
        return f"preprocessing: {self._finished} of {self._total} shard-writing tasks done"


class TrialProgress(ProgressArtifact):
    """A search's trials: the share of the budget ended, and how many completed, were pruned,
    failed or are running, with the best value so far, in its description."""

    def __init__(self, trials: int, warn: Callable[[str], None]) -> None:
        self._trials = trials
        self._counts: dict[str, int] = {}
        self._best = ""
        super().__init__(SEARCH_KEY, "search", warn)

    @property
    def percent(self) -> float:
        """Share of the budget's trials that ended, 0 to 100."""
        ended = sum(n for state, n in self._counts.items() if state != "running")
        return 100.0 * min(ended, self._trials) / self._trials

    def __call__(self, counts: dict[str, int], best: str) -> None:
        """The study's trials per state (complete, pruned, failed, running) and its best."""
        if (counts, best) != (self._counts, self._best):
            self._counts, self._best = dict(counts), best
            self._update()

    def _description(self) -> str:
        states = ("complete", "pruned", "failed", "running")
        done = ", ".join(f"{self._counts.get(s, 0)} {s}" for s in states)
        return f"search: {done} of {self._trials} trials" + (
            f"; best {self._best}" if self._best else ""
        )
