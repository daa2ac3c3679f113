"""A search's array tasks against a real Optuna study (SQLite) with real rank processes:
a rerun continues the study; when a killed task was the last, a new array resumes its trial
from its checkpoint and completes the budget."""

import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import submitit
from optuna.trial import TrialState

from tests.services import wait_for
from tests.unit.datasets import write_dataset
from trainflow.cluster import registry
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.search.array import run_arrays, tasks_needed
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.study import HANDED_ATTR, TASK_ATTR, StudyRef, make_ref, open_study
from trainflow.tasks.search.trial_worker import SearchJob, TrialWorker
from trainflow.tasks.search.watch import StudyWatch
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds")


def _job(
    root: Path,
    dataset: DatasetRef,
    trials: int,
    epochs: int = 2,
    train: dict[str, Any] | None = None,
    **search: Any,
) -> SearchJob:
    cfg = SearchConfig(
        space={"train.lr": "loguniform(1e-3,1e-2)"}, trials=trials, study="s", seed=0, **search
    )
    ref = make_ref(cfg, root, "local", "t", "val_accuracy", True)
    settings: dict[str, Any] = {"model": "reference_cnn", "batch_size": 32, **(train or {})}
    base_train = TrainConfig(epochs=epochs, precision="fp32", device="cpu", seed=3, **settings)
    base = TrainJobSpec(train=base_train, dataset=dataset, out_dir=root / "trials")
    return SearchJob(study=ref, base=base)


def _submit(
    root: Path, job: SearchJob, ranks: int = 1, cluster: ClusterConfig | None = None
) -> submitit.Job[Any]:
    open_study(job.study)  # the flow creates the study before the array starts
    executor = make_executor(cluster or ClusterConfig(ranks_per_node=ranks), root / "jobs")
    return executor.submit(TrialWorker(job))


def _trials(ref: StudyRef) -> list[Any]:
    return open_study(ref).get_trials()


_COUNTED_MODEL = """\
import gc
import math
import weakref

from torch import nn

BUILT = []


def build(spec):
    gc.collect()
    alive = sum(ref() is not None for ref in BUILT)
    print(f"models of earlier trials alive: {alive}", flush=True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(spec.sample_shape), spec.num_classes))
    BUILT.append(weakref.ref(model))
    return model
"""


def test_a_second_run_of_the_study_adds_trials_without_redoing_finished_ones(
    tmp_path: Path, dataset: DatasetRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two trials in one task of two ranks (DDP): each rank's model of the first trial is
    # released once it has ended, not kept for the task's life.
    (tmp_path / "counted_model.py").write_text(_COUNTED_MODEL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the ranks import the model from there
    model = "counted_model:build"
    first = _submit(tmp_path, _job(tmp_path, dataset, trials=2, train={"model": model}), 2)
    assert first.results()[0] == [0, 1]
    for rank in range(2):
        log = first.task(rank).stdout() or ""
        found = [line for line in log.splitlines() if line.startswith("models of earlier")]
        assert found == ["models of earlier trials alive: 0"] * 2, (rank, found)
    done = {t.number: t.datetime_complete for t in _trials(_job(tmp_path, dataset, 2).study)}
    assert len(done) == 2
    again = _job(tmp_path, dataset, trials=3, train={"model": model})
    assert _submit(tmp_path, again).results()[0] == [2]  # only the one the budget lacks
    trials = _trials(again.study)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert {t.number: t.datetime_complete for t in trials[:2]} == done
    assert sorted((tmp_path / "trials").glob("trial-*")) == [
        tmp_path / "trials" / f"trial-{i}" for i in range(3)
    ]


def test_a_lost_task_s_trial_is_resumed_by_a_new_array_and_the_budget_completed(
    tmp_path: Path,
) -> None:
    """The only task of the search is killed mid-trial: the flow's arrays (run_arrays) find
    no task left and the budget unspent, and submit another, which resumes the trial from its
    checkpoint and runs the rest of the budget."""
    # Epochs long enough (~1 s or more) to kill the task between epoch 1 and the end.
    big = write_dataset(tmp_path / "ds", n_train=12_000, n_val=256)
    job = _job(tmp_path, big, trials=2, epochs=3, heartbeat_interval_s=1, grace_period_s=3)
    open_study(job.study)  # the flow creates the study before the array starts
    checkpoint = tmp_path / "trials" / "trial-0" / "checkpoints"
    killed: list[int] = []

    def kill_after_epoch_one() -> None:
        def after_epoch_one() -> registry.ActiveJob | None:
            trials = _trials(job.study)
            saved = checkpoint.is_dir() and any(checkpoint.iterdir())
            jobs = registry.recorded(tmp_path)
            ready = trials and 1 in trials[0].intermediate_values and saved and jobs
            return jobs[0] if ready else None

        task = wait_for(after_epoch_one, 300, "trial 0's first epoch reported and checkpointed")
        (first,) = _trials(job.study)
        assert first.state == TrialState.RUNNING and 3 not in first.intermediate_values
        root = psutil.Process(int(task.job_id))  # the local executor's job id is its pid
        for proc in [*root.children(recursive=True), root]:
            proc.kill()  # as a lost node: no exit handler, no word to the study
            killed.append(proc.pid)

    killer = threading.Thread(target=kill_after_epoch_one, daemon=True)
    killer.start()
    said: list[str] = []
    watch = StudyWatch(job.study, said.append)
    one_rank = ClusterConfig(ranks_per_node=1)
    outcomes = run_arrays(job, 1, one_rank, tmp_path / "jobs", tmp_path, said.append, watch)
    killer.join(timeout=5)
    assert len(killed) >= 3  # the task's controller and its rank (guard and process)
    assert len(outcomes) == 2 and outcomes[1] == [1, 2]  # the lost task, then the new one
    failed, resumed, fresh = _trials(job.study)
    assert failed.state == TrialState.FAIL
    assert resumed.state == fresh.state == TrialState.COMPLETE
    assert resumed.system_attrs["failed_trial"] == 0  # the same trial, counted once
    assert resumed.params == failed.params
    assert resumed.intermediate_values[1] == failed.intermediate_values[1]
    assert sorted(resumed.intermediate_values) == [1, 2, 3]
    assert (
        sorted(fresh.intermediate_values) == [1, 2, 3] and "failed_trial" not in fresh.system_attrs
    )
    more = said.index("no search task is left and 2 trials to run: submitting more tasks")
    log = "\n".join(said[more:])  # the second array's lines
    assert "resuming from" in log and "after epoch" in log
    assert "epoch 1/3" not in log.split("trial 2:")[0]  # epoch 1 was not trained again
    assert not registry.recorded(tmp_path)  # every array forgotten


_DYING_MODEL = """\
import os
import signal


def build(spec):
    os.kill(os.getpid(), signal.SIGKILL)  # the trial kills its task, every time
"""


def test_a_trial_that_always_kills_its_task_ends_failed_after_max_retry(
    tmp_path: Path, dataset: DatasetRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dying_model.py").write_text(_DYING_MODEL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the ranks import the model from there
    beats = {"heartbeat_interval_s": 1, "grace_period_s": 2}
    job = _job(tmp_path, dataset, 1, train={"model": "dying_model:build"}, max_retry=1, **beats)
    open_study(job.study)
    said: list[str] = []
    watch = StudyWatch(job.study, said.append)
    one_rank = ClusterConfig(ranks_per_node=1)
    outcomes = run_arrays(job, 1, one_rank, tmp_path / "jobs", tmp_path, said.append, watch)
    assert len(outcomes) == 2  # the first try's task, then its one retry's: no more
    first, retry = _trials(job.study)
    assert first.state == retry.state == TrialState.FAIL
    assert retry.system_attrs["failed_trial"] == 0
    expected = "trial 0 failed on each of its 2 tries (trials 0, 1: its task was lost or the "
    expected += "trial failed); not tried again (max_retry 1)"
    assert expected in said, "\n".join(said)
    assert said.count("no search task is left and 1 trial to run: submitting more tasks") == 1


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # asked, not optimized
def test_a_trial_whose_task_died_before_its_first_heartbeat_is_retried(tmp_path: Path) -> None:
    """Optuna never finds such a trial stale (no heartbeat to age): the flow knows its task
    ended. A trial another search's task runs is left alone."""
    cfg = SearchConfig(
        space={"train.lr": "loguniform(1e-3,1e-2)"},
        trials=3,
        study="s",
        heartbeat_interval_s=1,
        grace_period_s=2,
    )
    ref = make_ref(cfg, tmp_path, "local", "t", "val_accuracy", True)
    study = open_study(ref)
    ours, theirs = study.ask(), study.ask()  # RUNNING, no heartbeat stored (as a task's at once)
    ours.set_user_attr(TASK_ATTR, "41")
    theirs.set_user_attr(TASK_ATTR, "elsewhere-7")
    ours.report(0.5, 1)
    said: list[str] = []
    assert tasks_needed(ref, 2, {}, {"40", "41"}, said.append) == 2  # the retry and one new
    lost, running, retry = open_study(ref).get_trials()
    assert lost.state == TrialState.FAIL and running.state == TrialState.RUNNING
    assert retry.state == TrialState.WAITING and retry.system_attrs["failed_trial"] == 0
    assert retry.intermediate_values == {1: 0.5}
    assert "trial 0: its task ended before the trial's first heartbeat: failed" in said


def test_a_trial_runs_to_its_end_across_its_task_s_time_limits(tmp_path: Path) -> None:
    # 96 steps an epoch of at least 0.3 s each: the trial outlasts its task's 1-minute limit.
    # The requeued task continues the same trial from its checkpoint at once (no wait for a
    # stale heartbeat), and its requeues with progress do not count against max_requeues (0).
    big = write_dataset(tmp_path / "ds", n_train=6144, n_val=128)
    slow = {"model": "tests.slow_model:slow_cnn", "model_args": {"sleep_s": 0.3}}
    job = _job(tmp_path, big, 1, train={"batch_size": 64, "time_limit_margin_s": 5.0, **slow})
    job = job.model_copy(update={"base": job.base.model_copy(update={"max_requeues": 0})})
    task = _submit(tmp_path, job, cluster=ClusterConfig(ranks_per_node=1, timeout_min=1))
    ran = task.results()[0]
    log = task.stdout() or ""
    assert "trial 0: queued again for the requeued task" in log, log[-3000:]
    assert "checkpointing at step" in log and "resuming from" in log, log[-3000:]
    *handed, done = _trials(job.study)
    assert [t.state for t in handed] == [TrialState.FAIL] * len(handed)
    assert done.state == TrialState.COMPLETE
    assert done.system_attrs["failed_trial"] == 0  # the same trial, counted once
    assert done.system_attrs[HANDED_ATTR] == handed[-1].number  # said "requeued", not failed
    assert sorted(done.intermediate_values) == [1, 2]
    assert ran == [done.number]  # the last attempt's: it finished the trial
