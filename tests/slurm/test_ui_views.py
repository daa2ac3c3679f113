"""What users see while and after a run, read off the real UIs by a headless Chromium.

One tiny pipeline trains on the dev Slurm's two nodes (one rank each), logs to a real MLflow
server and reports to a real Prefect server. The job is held before its second epoch (a gate)
while the Prefect UI shows the running flow's progress artifact at 50%; once the run is done,
the MLflow UI shows the experiment in its model-training view, the system metrics of both
nodes and the train run's dataset. Screenshots land in <repo>/test-artifacts/.
"""

import json
import threading
import urllib.request
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.browser import Page, chromium, require_chromium
from tests.gates import GatedJob
from tests.services import mlflow_server, post_ok, wait_for
from trainflow.flows.pipeline import pipeline
from trainflow.flows.report import MODEL_TRAINING_VIEW, experiment_link
from trainflow.tasks.preprocess.mlflow_dataset import DIGEST_CHARS
from trainflow.tasks.train import task as train_task_module

pytestmark = pytest.mark.timeout(900)

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
NODES = ("tfnode1", "tfnode2")
# The MLflow UI opens its assistant panel on a first visit; it would cover the screenshots.
HIDE_ASSISTANT = (
    "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
    "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
)


def _progress_at(api: str, flow_run_name: str, percent: float) -> dict[str, Any] | None:
    """The newest train-progress artifact of the flow run named `flow_run_name` when it shows
    `percent` (the Prefect server is the whole test run's: other tests' runs make artifacts of
    that key meanwhile)."""
    query = {
        "artifacts": {"key": {"any_": ["train-progress"]}},
        "flow_runs": {"name": {"any_": [flow_run_name]}},
        "sort": "CREATED_DESC",
    }
    found = post_ok(f"{api}/artifacts/filter", {**query, "limit": 1})
    return found[0] if found and float(found[0]["data"]) == percent else None


def _read_progress(page: Page, api: str, flow_run_name: str, shots: Path) -> None:
    """While the job waits at its gate: the Prefect UI shows the running flow at 50%."""
    artifact = wait_for(
        lambda: _progress_at(api, flow_run_name, 50.0), 600, "the progress artifact at 50%"
    )
    page.navigate(f"{api.removesuffix('/api')}/artifacts/artifact/{artifact['id']}")
    page.wait_for_text(["train-progress", "Progress: 50%", "epoch 1 of 2 checkpointed"], 120)
    page.screenshot(ARTIFACTS / "prefect-progress.png", shots / "prefect-progress.png")
    with urllib.request.urlopen(f"{api}/flow_runs/{artifact['flow_run_id']}", timeout=10) as r:
        assert json.load(r)["state_type"] == "RUNNING"


def _drain_prefect_workers() -> None:
    """Send Prefect's buffered logs and events while this test's server is still up: left for
    later, they would be retried against a stopped server when the session ends."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()
    EventsWorker.drain_all()


def _in_background(work: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """Run `work` on a thread, then `then` whatever happens; returns a join that re-raises."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)
        finally:
            then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> None:
        thread.join()
        if errors:
            raise errors[0]

    return join


def test_uis_show_progress_node_metrics_dataset_and_the_training_view(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: str
) -> None:
    binary = require_chromium()
    gate = tmp_path / "gate-2"
    monkeypatch.setattr(train_task_module, "TrainingJob", lambda spec: GatedJob(spec, {2: gate}))
    with ExitStack() as stack:
        url = stack.enter_context(mlflow_server(tmp_path / "mlflow"))
        api = prefect_api
        page = stack.enter_context(chromium(binary, tmp_path / "browser"))
        page.before_each_document(HIDE_ASSISTANT)
        stack.enter_context(temporary_settings({PREFECT_API_URL: api}))
        overrides = [
            f"workdir={tmp_path / 'work'}",
            "cluster.executor=slurm",
            "cluster.nodes=2",
            "cluster.ranks_per_node=1",
            f"tracking.tracking_uri={url}",
        ]
        name = f"ui-views-{uuid.uuid4().hex[:8]}"
        join = _in_background(lambda: _read_progress(page, api, name, tmp_path), gate.touch)
        try:
            summary = pipeline.with_options(flow_run_name=name)(preset="tiny", overrides=overrides)
        finally:
            gate.touch()
            join()
            _drain_prefect_workers()

        client = MlflowClient(url)
        exp = client.get_experiment_by_name(summary.experiment)
        assert exp is not None
        runs = client.search_runs(
            [exp.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
        )
        train = next(r for r in runs if r.info.run_name == "train")

        page.navigate(experiment_link(url, exp.experiment_id))
        # The model-training view: its sidebar and the runs table (stage runs nested).
        text = page.wait_for_text(["Model registry", "Run Name", "tiny", "4 matching runs"], 120)
        page.screenshot(ARTIFACTS / "mlflow-training-view.png", tmp_path / "view.png")
        assert "Judges" not in text and "Tool calls" not in text  # the GenAI view's

        route = f"{url}/#/experiments/{exp.experiment_id}/runs/{train.info.run_id}"
        page.navigate(f"{route}/system-metrics{MODEL_TRAINING_VIEW}")
        page.wait_for_text([f"system/{node}" for node in NODES], 120)
        page.wait_for_text(["cpu_utilization_percentage", "Time"], 120)  # charts drawn
        page.screenshot(ARTIFACTS / "mlflow-system-metrics.png", tmp_path / "system.png")

        page.navigate(f"{route}{MODEL_TRAINING_VIEW}")
        digest = summary.dataset_hash[:DIGEST_CHARS]
        page.wait_for_text(["Datasets", digest, "Training", "rank_samples_per_s_min", "mfu"], 120)
        page.screenshot(ARTIFACTS / "mlflow-train-run.png", tmp_path / "train.png")
