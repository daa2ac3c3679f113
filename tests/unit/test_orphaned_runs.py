"""A dead flow's runs are marked KILLED where RUNNING, never over a status they ended with."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.tasks.tracking import orphaned_runs


@pytest.mark.services
def test_the_run_and_its_parent_are_marked_killed_where_still_running(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("x", artifact_location=str(tmp_path / "art"))
    parent = client.create_run(exp, run_name="tiny").info.run_id
    tag = {orphaned_runs.PARENT_TAG: parent}
    done = client.create_run(exp, run_name="preprocess", tags=tag).info.run_id
    client.set_terminated(done, "FINISHED")
    train = client.create_run(exp, run_name="train", tags=tag).info.run_id
    assert orphaned_runs.main([uri, train]) == 0
    status = {r: client.get_run(r).info.status for r in (parent, done, train)}
    assert status == {parent: "KILLED", done: "FINISHED", train: "KILLED"}
    # Again (a second watchdog of the same run, say): nothing left to mark, nothing changed.
    assert orphaned_runs.mark_killed(uri, train) == []
    client.set_terminated(parent, "FAILED")
    assert orphaned_runs.mark_killed(uri, train) == []
    assert client.get_run(parent).info.status == "FAILED"


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert orphaned_runs.main(["http://127.0.0.1:9", "0" * 32]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"MLflow run {'0' * 32} not marked KILLED: http://127.0.0.1:9 is unreachable"]


@pytest.mark.services
def test_a_cancelled_search_kills_the_trial_runs_still_running_and_no_other(
    tmp_path: Path,
) -> None:
    from trainflow.tasks.search.task import kill_running_trial_runs

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("x", artifact_location=str(tmp_path / "art"))
    search = client.create_run(exp, run_name="tiny-search").info.run_id
    other = client.create_run(exp, run_name="other-search").info.run_id
    runs = {}
    for name, parent in (("set-up", search), ("done", search), ("elsewhere", other)):
        tags = {orphaned_runs.PARENT_TAG: parent}
        runs[name] = client.create_run(exp, run_name=name, tags=tags).info.run_id
    client.set_terminated(runs["done"], "FINISHED")
    assert kill_running_trial_runs(uri, search) == [runs["set-up"]]
    status = {name: client.get_run(r).info.status for name, r in runs.items()}
    assert status == {"set-up": "KILLED", "done": "FINISHED", "elsewhere": "RUNNING"}
    assert client.get_run(runs["set-up"]).data.tags["trial_state"] == "killed (cancelled)"
    assert client.get_run(search).info.status == "RUNNING"  # the flow ends it, not this
