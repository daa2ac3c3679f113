"""A search on the 2-node dev Slurm with its study in a real PostgreSQL: one job array whose
tasks pull trials until the budget is spent; a losing trial is pruned."""

import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from optuna.trial import TrialState

from tests.postgres import postgres
from trainflow.flows.search import search
from trainflow.tasks.search.config import SearchConfig
from trainflow.tasks.search.study import OVER_BUDGET_ATTR, make_ref, open_study

SPACE = {"train.lr": "choice(0.005,0.003,5.0)"}


@pytest.fixture(scope="module")
def study_db() -> Iterator[str]:
    with postgres() as server:
        if server is None:
            pytest.fail("no PostgreSQL: `apt-get install postgresql` failed")
        with psycopg.connect(f"postgresql://{server}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE studies")
        yield f"postgresql+psycopg://{server}/studies"


def test_array_tasks_on_slurm_pull_trials_from_postgresql_and_prune(
    tmp_path: Path, study_db: str
) -> None:
    cfg = SearchConfig(space=SPACE, storage=study_db, study="slurm-search")
    ref = make_ref(cfg, tmp_path, "slurm", "tiny", "val_accuracy", True)
    for lr in (0.005, 0.003, 5.0, 5.0):  # known-good first: the median rule prunes after them
        open_study(ref).enqueue_trial({"train.lr": lr})
    overrides = [f"workdir={tmp_path}", "cluster.executor=slurm", "cluster.ranks_per_node=1"]
    summary = search(
        preset="tiny",
        overrides=overrides,
        space=SPACE,
        trials=4,
        parallel=2,
        pruner="median",
        storage=study_db,
        study="slurm-search",
    )
    # Two tasks asking at the same moment for the last trial: the later one is refused
    # (over_budget, never trained); the study ran exactly the budget.
    trials = [t for t in open_study(ref).get_trials() if not t.user_attrs.get(OVER_BUDGET_ATTR)]
    assert len(trials) == 4 and all(t.state.is_finished() for t in trials)
    assert any(t.state == TrialState.PRUNED for t in trials), [
        (t.params, t.state, t.intermediate_values) for t in trials
    ]
    assert summary.best_params["train.lr"] in (0.005, 0.003)
    # One array of two tasks; each pulled trials (the log names the trials it trained).
    jobs = tmp_path / "runs" / summary.parent_run_id / "jobs"
    logs = sorted(jobs.glob("*_log.out"))
    assert len(logs) == 2 and len({p.name.split("_")[0] for p in logs}) == 1
    pulled = [len(re.findall(r"^trial \d+: \{", p.read_text(), re.MULTILINE)) for p in logs]
    assert sum(pulled) == 4 and min(pulled) >= 1, pulled
    assert not list((tmp_path / "active_jobs").glob("*.json"))  # every job forgotten
