"""A search's array tasks against a real Optuna study (SQLite) with real rank processes:
a rerun continues the study, a killed task's trial is retried from its checkpoint."""

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import submitit
from optuna.trial import TrialState

from tests.services import wait_for
from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.study import StudyRef, make_ref, open_study
from trainflow.tasks.search.trial_worker import SearchJob, TrialWorker
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
    settings: dict[str, Any] = {"batch_size": 32, **(train or {})}
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


def test_a_second_run_of_the_study_adds_trials_without_redoing_finished_ones(
    tmp_path: Path, dataset: DatasetRef
) -> None:
    first = _submit(tmp_path, _job(tmp_path, dataset, trials=2))
    assert first.results()[0] == [0, 1]
    done = {t.number: t.datetime_complete for t in _trials(_job(tmp_path, dataset, 2).study)}
    assert len(done) == 2
    again = _job(tmp_path, dataset, trials=3)
    assert _submit(tmp_path, again).results()[0] == [2]  # only the one the budget lacks
    trials = _trials(again.study)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert {t.number: t.datetime_complete for t in trials[:2]} == done
    assert sorted((tmp_path / "trials").glob("trial-*")) == [
        tmp_path / "trials" / f"trial-{i}" for i in range(3)
    ]


def test_a_killed_task_s_trial_is_retried_from_its_checkpoint(tmp_path: Path) -> None:
    # Epochs long enough (~1 s or more) to kill the task between epoch 1 and the end.
    big = write_dataset(tmp_path / "ds", n_train=12_000, n_val=256)
    job = _job(tmp_path, big, trials=1, epochs=3, heartbeat_interval_s=1, grace_period_s=3)
    task = _submit(tmp_path, job)
    checkpoint = tmp_path / "trials" / "trial-0" / "checkpoints"

    def after_epoch_one() -> bool | None:
        (trial,) = _trials(job.study) or [None]
        saved = checkpoint.is_dir() and any(checkpoint.iterdir())
        return (trial is not None and 1 in trial.intermediate_values and saved) or None

    wait_for(after_epoch_one, 300, "trial 0's first epoch reported and checkpointed")
    (first,) = _trials(job.study)
    assert first.state == TrialState.RUNNING and 3 not in first.intermediate_values
    root = psutil.Process(int(task.job_id))  # the local executor's job id is its pid
    for proc in [*root.children(recursive=True), root]:
        proc.kill()  # as a lost node: no exit handler, no word to the study
    time.sleep(job.study.grace_period_s + 1)  # its heartbeat goes stale
    retry = _submit(tmp_path, job)
    assert retry.results()[0] == [1]
    failed, resumed = _trials(job.study)
    assert failed.state == TrialState.FAIL and resumed.state == TrialState.COMPLETE
    assert resumed.system_attrs["failed_trial"] == 0  # the same trial, counted once
    assert resumed.params == failed.params
    assert resumed.intermediate_values[1] == failed.intermediate_values[1]
    assert sorted(resumed.intermediate_values) == [1, 2, 3]
    log = retry.stdout() or ""
    assert "resuming from" in log and "after epoch" in log
    assert "epoch 1/3" not in log  # epoch 1 was not trained again


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
    assert sorted(done.intermediate_values) == [1, 2]
    assert ran == [done.number]  # the last attempt's: it finished the trial
