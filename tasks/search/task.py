"""Prefect entry of a search's training: the arrays of trial-pulling tasks, watched
(tasks.search.array: another array when every task ended with the budget unspent;
tasks.search.watch: a line per trial that ended and the progress artifact).

A cancelled search (Ctrl-C, a Prefect cancellation) cancels the array, fails its running
trials in Optuna and marks their MLflow runs KILLED (each task does so for its trial as it
stops; what a task killed outright, or stopped between creating a trial's run and training it,
left RUNNING, the flow does: every trial run under the search's run still RUNNING).
"""

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.tasks.prefect_progress import TrialProgress
from trainflow.tasks.search.array import run_arrays
from trainflow.tasks.search.study import StudyRef, open_study
from trainflow.tasks.search.trial_runs import RUN_ATTR, close_trial_run
from trainflow.tasks.search.trial_worker import SearchJob
from trainflow.tasks.search.watch import StudyWatch
from trainflow.tasks.tracking.orphaned_runs import PARENT_TAG


@task(name="search-array", cache_policy=NO_CACHE, persist_result=False)
def search_task(
    job: SearchJob, parallel: int, cluster: ClusterConfig, job_dir: Path, workdir: Path
) -> list[Any]:
    """Run `parallel` array tasks that pull the study's trials until its budget is spent
    (more, when every task ended first: tasks.search.array); per task its trial numbers or
    the error it failed with."""
    logger = get_run_logger()
    check_cluster(cluster)
    try:
        watch = StudyWatch(job.study, logger.info, TrialProgress(job.study.trials, logger.warning))
        return run_arrays(job, parallel, cluster, job_dir, workdir, logger.info, watch)
    except BaseException:
        stopped = fail_running(job.study, job.base.tracking_uri)
        if stopped:
            logger.warning("trials %s were running: failed (cancelled)", stopped)
        if job.base.tracking_uri and job.parent_run_id:
            kill_running_trial_runs(job.base.tracking_uri, job.parent_run_id)
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


def kill_running_trial_runs(tracking_uri: str, parent_id: str) -> list[str]:
    """After a cancellation: the search run's trial runs still RUNNING marked KILLED,
    whatever their trial's state (a task stopped inside its trial's set-up fails the trial
    in Optuna and cannot close the run). The run ids."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_run(parent_id).info.experiment_id
    query = f"tags.`{PARENT_TAG}` = '{parent_id}' and attributes.status = 'RUNNING'"
    killed = []
    for run in client.search_runs([experiment], filter_string=query):
        close_trial_run(tracking_uri, run.info.run_id, "killed (cancelled)", "KILLED")
        killed.append(run.info.run_id)
    return killed
