"""MLflow run tree and batched logger against a real SQLite store."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.tasks.tracking.config import TrackingConfig
from trainflow.tasks.tracking.logger import MlflowLogger, NullLogger, make_logger
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.tracking.runs import resolve_tracking_uri


def _runs(tmp_path: Path) -> PipelineRuns:
    return PipelineRuns(TrackingConfig(experiment="t"), tmp_path, "p")


def test_default_store_is_sqlite_in_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = resolve_tracking_uri(TrackingConfig(), tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="http://x:1"), tmp_path) == "http://x:1"


def test_mlflow_tracking_uri_variable_is_used_unless_the_config_sets_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://server:5000")
    assert resolve_tracking_uri(TrackingConfig(), tmp_path) == "http://server:5000"
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="http://x:1"), tmp_path) == "http://x:1"


def test_parent_and_children_finish(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    with runs.parent({"a": "1"}) as parent, runs.stage("preprocess", {"b": "2"}) as child:
        runs.tag(child, {"k": "v"})
    client = MlflowClient(runs.tracking_uri)
    p, c = client.get_run(parent), client.get_run(child)
    assert p.info.status == "FINISHED" and c.info.status == "FINISHED"
    assert c.data.tags["mlflow.parentRunId"] == parent
    assert c.data.tags["k"] == "v" and c.data.params == {"b": "2"}
    assert p.data.params == {"a": "1"}
    assert "git_commit" in p.data.tags


def test_error_marks_failed_and_interrupt_marks_killed(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    with pytest.raises(ValueError), runs.parent({}) as parent, runs.stage("train", {}) as child:
        raise ValueError("boom")
    client = MlflowClient(runs.tracking_uri)
    assert client.get_run(parent).info.status == "FAILED"
    assert client.get_run(child).info.status == "FAILED"
    runs2 = _runs(tmp_path)
    with pytest.raises(KeyboardInterrupt), runs2.parent({}) as parent2:
        raise KeyboardInterrupt
    assert client.get_run(parent2).info.status == "KILLED"


def test_more_than_100_params_are_batched(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    params = {f"p{i:03d}": str(i) for i in range(250)}
    with runs.parent(params) as parent:
        pass
    assert len(MlflowClient(runs.tracking_uri).get_run(parent).data.params) == 250


def test_logger_buffers_until_flush(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    logger = make_logger(runs.tracking_uri, runs.parent_id, rank=0)
    assert isinstance(logger, MlflowLogger)
    for step in range(1, 4):
        logger.log({"loss": 1.0 / step, "acc": 0.1 * step}, step)
    client = MlflowClient(runs.tracking_uri)
    assert client.get_metric_history(runs.parent_id, "loss") == []
    logger.flush()  # hands the points to the sender thread; close() waits for it
    assert logger.close() == 0
    hist = client.get_metric_history(runs.parent_id, "loss")
    assert [m.step for m in hist] == [1, 2, 3]


def test_other_ranks_log_nothing() -> None:
    assert isinstance(make_logger("sqlite:///x.db", "abc", rank=1), NullLogger)
    assert isinstance(make_logger(None, None, rank=0), NullLogger)


def test_experiment_opens_as_model_training_and_a_chosen_kind_is_kept(tmp_path: Path) -> None:
    kind = "mlflow.experimentKind"
    runs = _runs(tmp_path)
    client = MlflowClient(runs.tracking_uri)
    assert client.get_experiment(runs.experiment_id).tags[kind] == "custom_model_development"
    # An experiment an older trainflow made (no kind) gets it; a user's choice stays.
    old = client.create_experiment("old", artifact_location=(tmp_path / "a").as_uri())
    chosen = client.create_experiment("chosen", tags={kind: "genai_development"})
    PipelineRuns(TrackingConfig(experiment="old"), tmp_path, "p")
    PipelineRuns(TrackingConfig(experiment="chosen"), tmp_path, "p")
    assert client.get_experiment(old).tags[kind] == "custom_model_development"
    assert client.get_experiment(chosen).tags[kind] == "genai_development"
