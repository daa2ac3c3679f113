"""A search's array tasks, submitted again while the budget is not spent and no task is left.

A task that dies (its node lost, the task killed and not requeued) leaves its trial RUNNING in
the study until the trial's heartbeat goes stale; a task still pulling trials then fails it
and runs its retry (RetryHeartbeatStaleTrialCallback). When every task of the array has ended,
nobody is left to ask: the flow then waits for those trials to go stale, fails them (their
retries queued, WAITING, with the intermediate values they reported) and submits a new array
of as many tasks as the retries and the unspent budget need, at most `parallel`. Each retry
resumes from its trial's last checkpoint.

Bounded: Optuna retries a trial at most the study's max_retry times (after that it stays
failed, said in one line), and an array that changed nothing in the study (its tasks ended
before any trial ran) is not submitted again.
"""

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trainflow.cluster import registry
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.cluster.jobs import wait_for_jobs
from trainflow.tasks.search.study import (
    OVER_BUDGET_ATTR,
    TASK_ATTR,
    StudyRef,
    budget_left,
    fail_and_retry,
    open_study,
    origin,
)
from trainflow.tasks.search.trial_worker import SearchJob, TrialWorker
from trainflow.tasks.search.watch import StudyWatch

SETTLE_POLL_S = 1.0
"""How often the flow looks for stale trials once every task has ended."""
SETTLE_SLACK_S = 5.0
"""Beyond a heartbeat's grace period: the database clock's resolution and a last beat."""


def run_arrays(
    job: SearchJob,
    parallel: int,
    cluster: ClusterConfig,
    job_dir: Path,
    workdir: Path,
    say: Callable[[str], None],
    watch: StudyWatch,
) -> list[Any]:
    """Run arrays of trial-pulling tasks until the study's budget is spent (or nothing more
    can be done); per task, in submission order, its trial numbers or the error it failed
    with. `say` gets the tasks' log lines and the search's own lines."""
    executor = make_executor(cluster, job_dir)
    outcomes: list[Any] = []
    ended: set[str] = set()  # every task this search submitted (all ended when asked)
    tasks = first_tasks(job.study, parallel, say)
    before = _states(open_study(job.study))
    while tasks:
        indices = list(range(len(outcomes), len(outcomes) + tasks))
        worker = TrialWorker(job.model_copy(update={"stream": len(before)}))
        jobs = executor.map_array(worker, indices)
        ids = ", ".join(str(j.job_id) for j in jobs)
        say(f"submitted {len(jobs)} search tasks as one array: {ids}")
        with ExitStack() as watched:
            for j in jobs:
                watched.enter_context(
                    registry.watching(workdir, str(j.job_id), cluster.executor, job_dir)
                )
            outcomes += wait_for_jobs(jobs, watch.watching(say))
        ended |= {str(j.job_id) for j in jobs}
        watch.poll()
        tasks = tasks_needed(job.study, parallel, before, ended, say)
        before = _states(open_study(job.study))
    return outcomes


def first_tasks(ref: StudyRef, parallel: int, say: Callable[[str], None]) -> int:
    """How many tasks the first array needs: none when the study's budget is spent (every
    trial it counts has ended: a rerun of a finished study is reported, not run again), else
    `parallel` at most."""
    import optuna

    study = open_study(ref)
    optuna.storages.fail_stale_trials(study)  # a killed search's trials: retries queued
    states = _states(study).values()
    need = sum(state == "WAITING" for state in states) + max(0, budget_left(study, ref.trials))
    if need > 0 or "RUNNING" in states:
        return min(parallel, max(need, 1))
    say(
        f"study {ref.name} has run its budget of {_trials(ref.trials)}: no task submitted "
        "(raise --trials to run more)"
    )
    return 0


def tasks_needed(
    ref: StudyRef,
    parallel: int,
    before: dict[int, str],
    ended: set[str],
    say: Callable[[str], None],
) -> int:
    """Once every task (`ended`: their ids) has ended: the lost tasks' trials failed and their
    retries queued, then how many tasks to submit for the retries and the unspent budget (0:
    the search is done, or the last array changed nothing in the study: `before`, its trials'
    states)."""
    study = open_study(ref)
    running = settle(study, ref, say)
    for number in never_beat(study, running, ended):
        if fail_and_retry(study, ref, number):
            say(f"trial {number}: its task ended before the trial's first heartbeat: failed")
    running = [t.number for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
    after = _states(study)
    for line in given_up(study, ref.max_retry, before):
        say(line)
    waiting = sum(state == "WAITING" for state in after.values())
    need = waiting + max(0, budget_left(study, ref.trials))
    if need <= 0:
        return 0
    if after == before:
        say(
            f"the search's tasks ended without running a trial ({_trials(need)} left, "
            "trials running elsewhere: " + (", ".join(map(str, running)) or "none") + "); "
            "see the tasks' logs above"
        )
        return 0
    say(f"no search task is left and {_trials(need)} to run: submitting more tasks")
    return min(parallel, need)


def settle(study: Any, ref: StudyRef, say: Callable[[str], None]) -> list[int]:
    """Fail the trials the ended tasks left RUNNING once their heartbeats are stale (the
    storage's callback queues their retries); the numbers of those still running after a
    grace period (another process runs them, or they never beat: not retried here)."""
    import optuna
    from optuna.trial import TrialState

    deadline = time.monotonic() + ref.grace_period_s + ref.heartbeat_interval_s + SETTLE_SLACK_S
    said = False
    while True:
        optuna.storages.fail_stale_trials(study)
        running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        if not running or time.monotonic() >= deadline:
            return running
        if not said:
            said = True
            were = "trial {} was" if len(running) == 1 else "trials {} were"
            say(
                f"{were.format(', '.join(map(str, running)))} running when the tasks ended: "
                f"retried once a heartbeat is {ref.grace_period_s} s old"
            )
        time.sleep(SETTLE_POLL_S)


def never_beat(study: Any, running: list[int], ended: set[str]) -> list[int]:
    """Of the trials still `running` once their heartbeats had time to go stale, those whose
    task is one of the `ended` ones (or unnamed: it died at once): its task ended before the
    trial's first heartbeat was stored (a trial killed in its first second, e.g. while its
    model is built), so no heartbeat ever goes stale. A trial another search runs names a
    task of its own and is left alone."""
    lost = []
    for t in study.get_trials(deepcopy=False):
        task = t.user_attrs.get(TASK_ATTR)
        if t.number in running and (task is None or task in ended):
            lost.append(t.number)
    return lost


def given_up(study: Any, max_retry: int, before: dict[int, str]) -> list[str]:
    """One line per retried trial that failed since `before` on its last allowed try
    (Optuna retries a lost trial at most max_retry times)."""
    trials = study.get_trials(deepcopy=False)
    alive = {origin(t) for t in trials if t.state.name != "FAIL"}  # retried, or succeeded
    lines = []
    for t in trials:
        if t.state.name != "FAIL" or before.get(t.number) == "FAIL" or origin(t) in alive:
            continue
        tries = [*t.system_attrs.get("retry_history", []), t.number]
        if len(tries) > max(max_retry, 1) and not t.user_attrs.get(OVER_BUDGET_ATTR):
            lines.append(
                f"trial {origin(t)} failed on each of its {len(tries)} tries (trials "
                f"{', '.join(map(str, tries))}: its task was lost or the trial failed); "
                f"not tried again (max_retry {max_retry})"
            )
    return lines


def _states(study: Any) -> dict[int, str]:
    """Each trial's state by number."""
    return {t.number: t.state.name for t in study.get_trials(deepcopy=False)}


def _trials(n: int) -> str:
    return f"{n} trial" if n == 1 else f"{n} trials"
