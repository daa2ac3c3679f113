"""Prefect entry of a search's training: the array of trial-pulling tasks, watched.

While the array runs, the study is read every few seconds (as the tasks' log lines are
forwarded) and each trial that ended is said in one line; a Prefect progress artifact shows
the trials done, pruned, failed and running, and the best so far.

A cancelled search (Ctrl-C, a Prefect cancellation) cancels the array, fails its running
trials in Optuna and marks their MLflow runs KILLED (each task does so for its trial as it
stops; what a task killed outright left RUNNING, the flow does).
"""

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainflow.cluster import registry
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_jobs
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.tasks.search.study import OVER_BUDGET_ATTR, StudyRef, open_study
from trainflow.tasks.search.trial_runs import RUN_ATTR, close_trial_run
from trainflow.tasks.search.trial_worker import SearchJob, TrialWorker
from trainflow.tasks.tracking.progress import TrialProgress

WATCH_S = 2.0
"""How often the flow reads the study for trials that ended."""


def trial_line(trial: Any, metric: str) -> str:
    """One line for an ended trial: number, outcome, value and parameters."""
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
    else:
        outcome = state.lower()
    return f"trial {trial.number:>3}: {outcome:<36} {params}"


def ended_trials(study: Any) -> list[Any]:
    """The study's trials that ended (complete, pruned, failed), in order; those asked for
    after the budget was spent (never trained) left out."""
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished() and not t.user_attrs.get(OVER_BUDGET_ATTR)
    ]


def progress_of(study: Any, metric: str) -> tuple[dict[str, int], str]:
    """The study's trials per state (complete, pruned, failed, running) and its best value."""
    counts: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get(OVER_BUDGET_ATTR) or trial.state.name == "WAITING":
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
        self, ref: StudyRef, say: Callable[[str], None], progress: TrialProgress | None = None
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
            counts = progress_of(study, self.ref.metric)
        except Exception as exc:
            self.say(f"warning: cannot read the study: {type(exc).__name__}: {exc}"[:400])
            return
        for trial in ended:
            if trial.number not in self.seen:
                self.seen.add(trial.number)
                self.say(trial_line(trial, self.ref.metric))
        if self.progress is not None:
            self.progress(*counts)


@task(name="search-array", cache_policy=NO_CACHE, persist_result=False)
def search_task(
    job: SearchJob, parallel: int, cluster: ClusterConfig, job_dir: Path, workdir: Path
) -> list[Any]:
    """Run `parallel` array tasks that pull the study's trials until its budget is spent;
    per task its trial numbers or the error it failed with."""
    logger = get_run_logger()
    check_cluster(cluster)
    executor = make_executor(cluster, job_dir)
    jobs = executor.map_array(TrialWorker(job), list(range(parallel)))
    ids = [str(j.job_id) for j in jobs]
    logger.info("submitted %d search tasks as one array: %s", len(jobs), ", ".join(ids))
    with ExitStack() as watched:
        for job_id in ids:
            watched.enter_context(registry.watching(workdir, job_id, cluster.executor, job_dir))
        try:
            watch = StudyWatch(
                job.study, logger.info, TrialProgress(job.study.trials, logger.warning)
            )
            outcomes = wait_for_jobs(jobs, watch.watching(logger.info))
            watch.poll()
            return outcomes
        except BaseException:
            stopped = fail_running(job.study, job.base.tracking_uri)
            if stopped:
                logger.warning("trials %s were running: failed (cancelled)", stopped)
            raise


def fail_running(ref: StudyRef, tracking_uri: str | None) -> list[int]:
    """After a cancellation: the study's trials still running failed, their MLflow runs
    KILLED. The trial numbers."""
    import optuna
    from optuna.trial import TrialState

    study = open_study(ref)
    stopped = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # it ended meanwhile
        stopped.append(trial.number)
        run_id = trial.user_attrs.get(RUN_ATTR)
        if tracking_uri and run_id:
            close_trial_run(tracking_uri, run_id, "killed (cancelled)", "KILLED")
    return stopped
