"""What the flow says of a search while its tasks run: each trial that ended, in one line,
and the Prefect progress artifact (trials done, pruned, failed and running, the best so far),
read from the study every few seconds as the tasks' log lines are forwarded.
"""

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainflow.tasks.search.study import HANDED_ATTR, OVER_BUDGET_ATTR, StudyRef, open_study

if TYPE_CHECKING:
    from trainflow.tasks.prefect_progress import TrialProgress

WATCH_S = 2.0
"""How often the flow reads the study for trials that ended."""


def trial_line(trial: Any, metric: str, continued_as: int | None = None) -> str:
    """One line for an ended trial: number, outcome, value and parameters; `continued_as`:
    the trial that continues it, if it was handed over at its task's requeue."""
    state = trial.state.name
    params = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items()
    )
    if state == "COMPLETE":
        outcome = f"complete  {metric} {trial.value:.4f}"
    elif state == "PRUNED":
        last = max(trial.intermediate_values, default=0)
        value = trial.intermediate_values.get(last, float("nan"))
        outcome = f"pruned at epoch {last}  {metric} {value:.4f}"
    elif state == "FAIL" and continued_as is not None:
        outcome = f"requeued, continued as trial {continued_as}"
    else:
        outcome = {"FAIL": "failed"}.get(state, state.lower())
    return f"trial {trial.number:>3}: {outcome:<36} {params}"


def ended_trials(study: Any) -> list[Any]:
    """The study's trials that ended (complete, pruned, failed), in order; those asked for
    after the budget was spent (never trained) left out."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished() and not t.user_attrs.get(OVER_BUDGET_ATTR)
    ]


def handed_over(study: Any) -> dict[int, int]:
    """Trials failed only to go on after their task's requeue (study.hand_over): each one's
    number -> the number of the trial that continues it."""
    return {
        int(t.system_attrs[HANDED_ATTR]): t.number
        for t in study.get_trials(deepcopy=False)
        if HANDED_ATTR in t.system_attrs
    }


def trial_lines(study: Any, metric: str) -> list[str]:
    """A line for each of the study's ended trials (ended_trials), in order."""
    handed = handed_over(study)
    return [trial_line(t, metric, handed.get(t.number)) for t in ended_trials(study)]


def progress_of(study: Any, metric: str) -> tuple[dict[str, int], str]:
    """The study's trials per state (complete, pruned, failed, running) and its best value."""
    counts: dict[str, int] = {}
    handed = handed_over(study)
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get(OVER_BUDGET_ATTR) or trial.state.name == "WAITING":
            continue
        if trial.number in handed:  # goes on as another trial
            continue
        state = {"COMPLETE": "complete", "PRUNED": "pruned", "RUNNING": "running"}
        key = state.get(trial.state.name, "failed")
        counts[key] = counts.get(key, 0) + 1
    best = ""
    if counts.get("complete"):
        best = f"{metric} {study.best_value:.4f} (trial {study.best_trial.number})"
    return counts, best


class StudyWatch:
    """Says each trial that ended once and updates the progress artifact: read from the study
    as the array's log lines are forwarded (at most every WATCH_S), and once at the end."""

    def __init__(
        self, ref: StudyRef, say: Callable[[str], None], progress: "TrialProgress | None" = None
    ) -> None:
        self.ref, self.say, self.progress = ref, say, progress
        self.seen = {t.number for t in ended_trials(open_study(ref))}  # earlier runs'
        self._last = time.monotonic()

    def watching(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, then a look at the study when WATCH_S have passed since the last."""

        def log_and_poll(line: str) -> None:
            log(line)
            if time.monotonic() - self._last >= WATCH_S:
                self.poll()

        return log_and_poll

    def poll(self) -> None:
        """Say the trials that ended since the last poll; update the progress artifact. A
        database that does not answer is one warning, tried again at the next poll."""
        self._last = time.monotonic()
        try:
            study = open_study(self.ref)
            ended = ended_trials(study)
            handed = handed_over(study)
            counts = progress_of(study, self.ref.metric)
        except Exception as exc:
            self.say(f"warning: cannot read the study: {type(exc).__name__}: {exc}"[:400])
            return
        for trial in ended:
            if trial.number not in self.seen:
                self.seen.add(trial.number)
                self.say(trial_line(trial, self.ref.metric, handed.get(trial.number)))
        if self.progress is not None:
            self.progress(*counts)
