"""The MLflow UI, opened in a real headless Chromium, shows what a real pipeline run logged.

One tiny pipeline runs in-process (under the session's Prefect test harness), `trainflow ui`
serves its store on loopback, and Chromium renders the UI's pages: the assertions read the
page text a person would read, after the single-page app has fetched its data. Screenshots
are kept under <repo>/test-artifacts/ (and the test's tmp folder) for people to look at.
"""

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from tests.browser import Page, chromium, require_chromium
from tests.services import background, free_port, http_status, service_env, wait_for
from trainflow.flows.pipeline import PipelineSummary, pipeline

pytestmark = pytest.mark.integration

EXPERIMENT = "browser-check-experiment"
RUN_NAME = "browser-check-run"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# The UI opens its assistant panel on a first visit; it would cover a third of each screenshot.
HIDE_ASSISTANT = (
    "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
    "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
)
# Training-run views (the UI starts in its GenAI views otherwise).
MODEL_TRAINING = "?workflowType=machine_learning"


@pytest.fixture(scope="session")
def chromium_binary() -> Path:
    """Debian's Chromium, installed once per session when missing (skip locally, fail in CI)."""
    return require_chromium()


@dataclass(frozen=True)
class Served:
    """A pipeline run, the UI serving its store, and a browser tab on that UI."""

    summary: PipelineSummary
    experiment_id: str
    evaluate_run_id: str
    url: str
    page: Page
    shots: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, chromium_binary: Path) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("mlflow-ui")
    workdir = folder / "work"
    overrides = [f"workdir={workdir}", f"name={RUN_NAME}", f"tracking.experiment={EXPERIMENT}"]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)  # the workdir's own store
        summary = pipeline(preset="tiny", overrides=overrides)
    client = MlflowClient(summary.tracking_uri)
    parent = client.get_run(summary.parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{summary.parent_run_id}'"
    )
    evaluate = next(r for r in children if r.info.run_name == "evaluate")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "trainflow.flows.cli",
        "ui",
        "--port",
        str(port),
        "--set",
        overrides[0],
    ]
    ui_env = {k: v for k, v in service_env().items() if k != "MLFLOW_TRACKING_URI"}
    with background(argv, folder / "ui.log", ui_env):
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_status(f"{url}/health") == 200, 120, "the MLflow UI")
        with chromium(chromium_binary, folder / "browser") as page:
            page.before_each_document(HIDE_ASSISTANT)
            yield Served(
                summary, parent.info.experiment_id, evaluate.info.run_id, url, page, folder
            )


def _screenshot(served: Served, name: str) -> None:
    served.page.screenshot(ARTIFACTS / name, served.shots / name)


def ui_number(value: float) -> str:
    """A metric value as the run page prints it (JavaScript's Number.toString)."""
    return str(int(value)) if value == int(value) else repr(value)


def test_run_page_shows_experiment_run_and_test_accuracy(served: Served) -> None:
    run_id = served.summary.parent_run_id
    route = f"#/experiments/{served.experiment_id}/runs/{run_id}"
    served.page.navigate(f"{served.url}/{route}{MODEL_TRAINING}")
    accuracy = ui_number(served.summary.test_accuracy)
    text = served.page.wait_for_text([EXPERIMENT, RUN_NAME, "test_accuracy", run_id], 120)
    _screenshot(served, "mlflow-ui.png")
    # The value sits in the metrics table right after its name.
    assert re.search(rf"(^|\n)test_accuracy\s+{re.escape(accuracy)}(\s|$)", text), text[:3000]
    assert served.summary.test_accuracy > 0.6


def test_experiment_page_lists_the_pipeline_run(served: Served) -> None:
    page = f"{served.url}/#/experiments/{served.experiment_id}/runs{MODEL_TRAINING}"
    served.page.navigate(page)
    served.page.wait_for_text([EXPERIMENT, RUN_NAME, "Run Name"], 120)
    _screenshot(served, "mlflow-ui-experiment.png")


def test_artifacts_tab_renders_the_evaluation_plot(served: Served) -> None:
    plot = MlflowClient(served.summary.tracking_uri).download_artifacts(
        served.evaluate_run_id, "confusion_matrix.png", str(served.shots)
    )
    width, height = Image.open(plot).size
    route = f"#/experiments/{served.experiment_id}/runs/{served.evaluate_run_id}/artifacts"
    served.page.navigate(f"{served.url}/{route}/confusion_matrix.png{MODEL_TRAINING}")
    served.page.wait_for_text(["confusion_matrix.png", "training_curves.png"], 120)
    # The preview is an <img> the app fills from the server's artifact endpoint: wait until
    # an image of the plot's exact size has loaded and decoded.
    decoded = (
        "[...document.images].some(i => i.complete && "
        f"i.naturalWidth === {width} && i.naturalHeight === {height})"
    )
    wait_for(lambda: served.page.evaluate(decoded), 120, f"a {width}x{height} plot image")
    _screenshot(served, "mlflow-ui-artifact.png")
