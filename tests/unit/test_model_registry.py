"""Model registry and the champion alias, against a real SQLite MLflow store with real models."""

from collections.abc import Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.services import mlflow_server
from trainflow.tasks.evaluate.model_logging import log_model
from trainflow.tasks.evaluate.registry import (
    Champion,
    RegistryResult,
    promote,
    read_champion,
    register_and_promote,
)
from trainflow.tasks.tracking.runs import use_tracking_uri

TAGS = {"dataset_hash": "d" * 64, "git_commit": "abc123", "config_hash": "c" * 64}
METRIC = "test_accuracy"


class Store:
    """A real MLflow SQLite store with one experiment; logs a tiny torch model per run."""

    def __init__(self, uri: str, artifacts: str | None = None) -> None:
        self.uri = uri
        self.client = MlflowClient(uri)
        self.exp = self.client.create_experiment("t", artifacts)

    def evaluated(self, value: float | None, seed: int = 0) -> tuple[str, str]:
        """An evaluate run holding the metric (unless None) and a logged model: (run id, URI)."""
        run_id = self.client.create_run(self.exp).info.run_id
        if value is not None:
            self.client.log_metric(run_id, METRIC, value)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
        uri = log_model(model, np.zeros((2, 1, 2, 2), np.float32), self.uri, run_id)
        return run_id, uri

    def register(self, name: str, value: float) -> RegistryResult:
        run_id, uri = self.evaluated(value)
        return register_and_promote(self.client, uri, name, run_id, METRIC, value, TAGS)

    def alias(self, name: str) -> str:
        return str(self.client.get_model_version_by_alias(name, "champion").version)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    folder = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    # The tests' own direct calls (create_model_version of a models:/ source, load_model) go
    # through MLflow's global URI; trainflow's code sets it only around its own calls.
    with use_tracking_uri(uri):
        yield Store(uri, (folder / "art").as_uri())


@pytest.mark.services
def test_first_version_becomes_champion_with_tags(store: Store) -> None:
    run_id, uri = store.evaluated(0.8)
    res = register_and_promote(store.client, uri, "first", run_id, METRIC, 0.8, TAGS)
    assert (res.version, res.champion, res.previous_version) == ("1", True, None)
    assert store.alias("first") == "1"
    mv = store.client.get_model_version("first", "1")
    assert {k: mv.tags[k] for k in TAGS} == TAGS
    assert float(mv.tags[METRIC]) == 0.8
    assert mv.run_id == run_id
    run_tags = store.client.get_run(run_id).data.tags
    assert run_tags["registered_model_name"] == "first"
    assert run_tags["registered_model_version"] == "1"
    assert run_tags["champion"] == "true"
    # The registered version loads and predicts like the logged model.
    loaded = mlflow.pytorch.load_model("models:/first@champion")
    assert loaded(torch.zeros(1, 1, 2, 2)).shape == (1, 2)
    logged = store.client.get_logged_model(uri.removeprefix("models:/"))
    assert '"version": "1"' in logged.tags["mlflow.modelVersions"]


@pytest.mark.services
def test_better_version_moves_the_alias(store: Store) -> None:
    store.register("better", 0.80)
    res = store.register("better", 0.85)
    assert (res.version, res.champion) == ("2", True)
    assert (res.previous_version, res.previous_metric) == ("1", 0.80)
    assert store.alias("better") == "2"


def test_worse_version_keeps_the_champion(store: Store) -> None:
    store.register("worse", 0.80)
    res = store.register("worse", 0.79)
    assert (res.version, res.champion, res.previous_version) == ("2", False, "1")
    assert "does not beat version 1" in res.reason
    assert store.alias("worse") == "1"
    worse_run = store.client.get_model_version("worse", "2").run_id
    assert worse_run is not None
    run_tags = store.client.get_run(worse_run).data.tags
    assert run_tags["champion"] == "false"
    assert run_tags["previous_champion_version"] == "1"


def test_a_tie_keeps_the_champion(store: Store) -> None:
    store.register("tie", 0.8125)
    res = store.register("tie", 0.8125)
    assert not res.champion
    assert store.alias("tie") == "1"
    # A later strictly better version still wins against the unchanged champion.
    assert store.register("tie", 0.8126).champion
    assert store.alias("tie") == "3"


@pytest.mark.services
def test_champion_without_metric_tag_is_compared_by_its_run_metric(store: Store) -> None:
    # As registered by an older trainflow: no metric tag on the version, metric on its run.
    run_id, uri = store.evaluated(0.9)
    store.client.create_registered_model("legacy")
    store.client.create_model_version("legacy", uri, run_id=run_id, tags=TAGS)
    store.client.set_registered_model_alias("legacy", "champion", "1")
    assert read_champion(store.client, "legacy", "champion", METRIC) == ("1", 0.9)
    worse = store.register("legacy", 0.85)
    assert (worse.champion, worse.previous_metric) == (False, 0.9)
    better = store.register("legacy", 0.95)
    assert (better.champion, better.previous_version, better.previous_metric) == (True, "1", 0.9)
    assert store.alias("legacy") == "3"


def test_champion_with_no_metric_anywhere_is_left_in_place(store: Store) -> None:
    run_id, uri = store.evaluated(None)
    store.client.create_registered_model("manual")
    store.client.create_model_version("manual", uri, run_id=run_id)
    store.client.set_registered_model_alias("manual", "champion", "1")
    res = store.register("manual", 0.99)
    assert not res.champion
    assert "no comparable metric" in res.reason
    assert store.alias("manual") == "1"


@pytest.mark.services
def test_champion_is_read_again_right_before_the_move(store: Store) -> None:
    # Pipeline A reads the champion (v1, 0.80) and decides 0.85 wins; meanwhile pipeline B
    # registers 0.90 and takes the alias. A's re-check must see B's version and stand down.
    store.register("race", 0.80)
    seen_by_a = read_champion(store.client, "race", "champion", METRIC)
    assert seen_by_a == Champion("1", 0.80)
    _, uri_a = store.evaluated(0.85)
    version_a = str(store.client.create_model_version("race", uri_a).version)
    assert store.register("race", 0.90).champion  # pipeline B, version 3
    moved, holder, reason = promote(
        store.client, "race", "champion", version_a, METRIC, 0.85, seen_by_a
    )
    assert not moved
    assert holder == ("3", 0.90)
    assert "does not beat version 3" in reason
    assert store.alias("race") == "3"


@pytest.mark.services
def test_alias_name_is_configurable(store: Store) -> None:
    run_id, uri = store.evaluated(0.5)
    res = register_and_promote(store.client, uri, "aliased", run_id, METRIC, 0.5, TAGS, "best")
    assert res.champion and res.alias == "best"
    assert str(store.client.get_model_version_by_alias("aliased", "best").version) == "1"


@pytest.mark.services
def test_the_same_through_an_mlflow_tracking_server(tmp_path: Path) -> None:
    # A real `mlflow server` (REST, artifacts proxied): versions come back as text there.
    with mlflow_server(tmp_path, env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}) as url:
        server = Store(url)
        first = server.register("served", 0.7)
        assert (first.version, first.champion) == ("1", True)
        tie = server.register("served", 0.7)
        assert (tie.version, tie.champion, tie.previous_version) == ("2", False, "1")
        better = server.register("served", 0.75)
        assert (better.champion, better.previous_metric) == (True, 0.7)
        assert server.alias("served") == "3"
        with use_tracking_uri(url):
            loaded = mlflow.pytorch.load_model("models:/served@champion")
        assert loaded(torch.zeros(1, 1, 2, 2)).shape == (1, 2)
