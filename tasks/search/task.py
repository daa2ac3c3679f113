"""Prefect entry of a search's training: the array of trial-pulling tasks, watched.

While the array runs, the study is read every few seconds and each trial that ended is said
in one line. A cancelled search (Ctrl-C, a Prefect cancellation) cancels the array, fails
its running trials in Optuna and marks their MLflow runs KILLED (each task does so for its
trial as it stops; what a task killed outright left RUNNING, the flow does).
"""

import threading
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
from trainflow.tasks.search.study import StudyRef, open_study
from trainflow.tasks.search.trial_runs import RUN_ATTR, close_trial_run
from trainflow.tasks.search.trial_worker import SearchJob, TrialWorker

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
    from trainflow.tasks.search.study import OVER_BUDGET_ATTR

    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished() and not t.user_attrs.get(OVER_BUDGET_ATTR)
    ]


class StudyWatch:
    """Says each trial that ended once, from a thread reading the study every WATCH_S."""

    def __init__(self, ref: StudyRef, say: Callable[[str], None]) -> None:
        self.ref, self.say = ref, say
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="study-watch", daemon=True)

    def __enter__(self) -> "StudyWatch":
        self.seen = {t.number for t in ended_trials(open_study(self.ref))}  # earlier runs'
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def poll(self) -> None:
        """Say the trials that ended since the last poll."""
        for trial in ended_trials(open_study(self.ref)):
            if trial.number not in self.seen:
                self.seen.add(trial.number)
                self.say(trial_line(trial, self.ref.metric))

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                self.poll()
            except Exception as exc:  # the database busy or away: said, tried again
                self.say(f"warning: cannot read the study: {type(exc).__name__}: {exc}")


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
            with StudyWatch(job.study, logger.info):
                return wait_for_jobs(jobs, logger.info)
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
