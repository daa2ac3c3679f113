"""What a seeded search's array tasks draw, through the flow's arrays (run_arrays) and real
task processes against a real Optuna study (SQLite): every trial a point of its own, across
tasks and across a later run of the same study; a grid covered once."""

from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from tests.unit.datasets import write_dataset
from trainflow.cluster.config import ClusterConfig
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.search.array import run_arrays
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.study import OVER_BUDGET_ATTR as OVER_BUDGET
from trainflow.tasks.search.study import make_ref, open_study
from trainflow.tasks.search.trial_worker import SearchJob
from trainflow.tasks.search.watch import StudyWatch
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.job import TrainJobSpec

pytestmark = pytest.mark.integration

SPACE: dict[str, str | list[Any]] = {
    "train.lr": "loguniform(1e-3,1e-2)",
    "train.batch_size": "int(16,64)",
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_dataset(tmp_path_factory.mktemp("data") / "ds", n_train=128, n_val=32)


def _search(root: Path, dataset: DatasetRef, trials: int, **search: Any) -> SearchJob:
    cfg = SearchConfig(trials=trials, study="s", seed=3, pruner="none", **search)
    ref = make_ref(cfg, root, "local", "t", "val_accuracy", True)
    train = TrainConfig(
        model="reference_cnn", epochs=1, precision="fp32", device="cpu", seed=0, batch_size=32
    )
    base = TrainJobSpec(train=train, dataset=dataset, out_dir=root / "trials")
    return SearchJob(study=ref, base=base)


def _run(root: Path, job: SearchJob, said: list[str] | None = None) -> list[dict[str, Any]]:
    """Two array tasks pull the study's trials until its budget is spent; every trial's values
    (`said`: the search's lines)."""
    open_study(job.study)  # the flow creates the study before the array starts
    said = [] if said is None else said
    cluster = ClusterConfig(ranks_per_node=1)
    watch = StudyWatch(job.study, said.append)
    run_arrays(job, 2, cluster, root / "jobs", root, said.append, watch)
    # A trial two tasks asked for at the same moment, past the budget, fails at once and
    # counts for nothing (tasks.search.study.over_budget): not one of the search's points.
    trials = [t for t in open_study(job.study).get_trials() if not t.user_attrs.get(OVER_BUDGET)]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * len(trials), "\n".join(said)
    return [t.params for t in trials]


def _distinct(params: list[dict[str, Any]]) -> int:
    return len({tuple(sorted(p.items())) for p in params})


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_seeded_search_draws_a_new_point_for_every_trial_and_every_continuation(
    tmp_path: Path, dataset: DatasetRef, sampler: str
) -> None:
    first = _run(tmp_path, _search(tmp_path, dataset, 6, space=SPACE, sampler=sampler))
    assert len(first) == 6 and _distinct(first) == 6, first
    continued = _run(tmp_path, _search(tmp_path, dataset, 10, space=SPACE, sampler=sampler))
    assert continued[:6] == first and _distinct(continued) == 10, continued


def test_a_grid_search_of_two_tasks_covers_its_grid_once(
    tmp_path: Path, dataset: DatasetRef
) -> None:
    grid: dict[str, str | list[Any]] = {"train.lr": [0.001, 0.01], "train.batch_size": [16, 32, 64]}
    params = _run(tmp_path, _search(tmp_path, dataset, 16, space=grid, sampler="grid"))
    expected = {(bs, lr) for lr in (0.001, 0.01) for bs in (16, 32, 64)}
    assert len(params) == 6  # the grid's size caps the budget
    assert {(p["train.batch_size"], p["train.lr"]) for p in params} == expected
    said: list[str] = []
    again = _run(tmp_path, _search(tmp_path, dataset, 16, space=grid, sampler="grid"), said)
    assert again == params  # a finished study run again: reported, nothing submitted
    assert said == [
        "study s has run its budget of 6 trials: no task submitted (raise --trials to run more)"
    ]
