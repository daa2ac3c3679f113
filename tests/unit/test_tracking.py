"""MLflow run tree and batched logger against a real SQLite store."""

import math
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from trainflow.tasks.tracking.config import TrackingConfig, resolve_tracking_uri
from trainflow.tasks.tracking.journal import Journal, Point, read_records
from trainflow.tasks.tracking.logged_through import handed_through
from trainflow.tasks.tracking.logger import (
    JournalLogger,
    NullLogger,
    log_run_params,
    make_logger,
    tag_run,
)
from trainflow.tasks.tracking.pipeline_runs import PipelineRuns
from trainflow.tasks.tracking.relay import Relay, relaying


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


@pytest.mark.services
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


@pytest.mark.services
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


@pytest.mark.services
def test_more_than_100_params_are_batched(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    params = {f"p{i:03d}": str(i) for i in range(250)}
    with runs.parent(params) as parent:
        pass
    assert len(MlflowClient(runs.tracking_uri).get_run(parent).data.params) == 250


@pytest.mark.services
def test_the_logger_journals_at_each_flush_and_the_relay_sends_it(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    out = tmp_path / "out"
    logger = make_logger(Journal(out, "rank0"))
    assert isinstance(logger, JournalLogger)
    for step in range(1, 4):
        logger.log({"loss": 1.0 / step, "acc": 0.1 * step}, step)
    lines: list[str] = []
    relay = Relay(out, runs.tracking_uri, runs.parent_id, say=lines.append)
    relay.pump()
    assert relay.points == 0 and handed_through(out) == 0  # buffered: nothing journaled yet
    logger.flush()
    assert handed_through(out) == 3  # a resumed attempt logs from step 4 on
    log_run_params(Journal(out, "rank0"), {"precision.used": "fp32"})
    tag_run(Journal(out, "rank0"), {"mfu_peak": "measured"})
    logger.log({"loss": float("nan")}, 4)
    assert logger.close() == 0
    relay.finish()
    client = MlflowClient(runs.tracking_uri)
    hist = sorted(client.get_metric_history(runs.parent_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in hist] == [1, 2, 3, 4] and math.isnan(hist[-1].value)
    assert relay.points == 7 and lines == []
    run = client.get_run(runs.parent_id)
    assert run.data.params["precision.used"] == "fp32" and run.data.tags["mfu_peak"] == "measured"
    # A new relay over the same journal (a resumed run) sends it again: stored once.
    Relay(out, runs.tracking_uri, runs.parent_id, say=lines.append).finish()
    assert sorted(m.step for m in client.get_metric_history(runs.parent_id, "loss")) == [1, 2, 3, 4]


def test_a_failed_job_still_gets_what_it_journaled_and_its_own_error(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    out, lines = tmp_path / "out", list[str]()
    with (
        pytest.raises(RuntimeError, match="rank 1 lost"),
        relaying(out, runs.tracking_uri, runs.parent_id, lines.append),
    ):
        logger = make_logger(Journal(out, "rank0"))
        logger.log({"loss": 0.5}, 1)
        logger.flush()
        raise RuntimeError("rank 1 lost")
    client = MlflowClient(runs.tracking_uri)
    assert [m.step for m in client.get_metric_history(runs.parent_id, "loss")] == [1]
    with relaying(out, None, None, lines.append) as none:  # no run: no relay
        assert none is None
    assert lines == []


def test_a_cut_last_line_is_left_until_it_is_whole(tmp_path: Path) -> None:
    journal = Journal(tmp_path, "rank0")
    journal.metrics([("x", 1.0, 5, 1)])
    with journal.path.open("ab") as f:
        f.write(b'{"metrics":[["x",2.0,6')  # a record still being written
    records, end = read_records(journal.path, 0)
    assert records == [{"metrics": [["x", 1.0, 5, 1]]}]
    with journal.path.open("ab") as f:
        f.write(b",2]]}\n")
    assert read_records(journal.path, end)[0] == [{"metrics": [["x", 2.0, 6, 2]]}]


def test_the_handed_step_is_the_last_whole_flush_s(tmp_path: Path) -> None:
    logger = make_logger(Journal(tmp_path, "rank0"))
    logger.log({"loss": 0.5}, 16)
    logger.flush()
    logger.log({"loss": 0.4}, 32)
    logger.flush()
    path = tmp_path / "tracking" / "rank0.jsonl"
    whole = path.read_bytes()
    assert whole.count(b"\n") == 2 and handed_through(tmp_path) == 32
    path.write_bytes(whole[:-3])  # the last record cut (a full disk): its points are not sent
    assert handed_through(tmp_path) == 16
    (record,) = read_records(path, 0)[0]
    assert record["through"] == 16 and [(k, v, step) for k, v, _, step in record["metrics"]] == [
        ("loss", 0.5, 16)
    ]


def test_log_does_not_wait_for_a_flush_s_write(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    class SlowJournal(Journal):  # a disk that holds the write until told
        def metrics(self, points: Iterable[Point], through: int | None = None) -> None:
            entered.set()
            release.wait(30)
            super().metrics(points, through)

    logger = make_logger(SlowJournal(tmp_path, "rank0"))
    logger.log({"loss": 0.5}, 1)
    flushing = threading.Thread(target=logger.flush)
    flushing.start()
    assert entered.wait(30)
    logger.log({"loss": 0.4}, 2)  # returns while the write is held (else: a deadlock here)
    release.set()
    flushing.join()
    logger.flush()
    steps = [r["through"] for r in read_records(tmp_path / "tracking" / "rank0.jsonl", 0)[0]]
    assert steps == [1, 2]


def test_other_ranks_and_jobs_without_a_run_log_nothing(tmp_path: Path) -> None:
    assert isinstance(make_logger(None), NullLogger)
    log_run_params(None, {"a": "b"})
    tag_run(None, {"a": "b"})
    assert not (tmp_path / "tracking").exists()


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
