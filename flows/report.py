"""The pipeline run's summary as Markdown, for the Prefect UI's artifact tab."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from trainflow.tasks.preprocess.ref import DatasetRef

if TYPE_CHECKING:  # annotations only: the evaluate modules import torch and MLflow
    from trainflow.tasks.evaluate.registry import RegistryResult
    from trainflow.tasks.evaluate.run import EvalResult

HEADLINE_PLOTS = {
    "training curves": "training_curves.png",
    "confusion matrix": "confusion_matrix.png",
}
"""The evaluate run's plots the summary shows: title -> artifact path."""


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI's address: the tracking server's, or `trainflow ui`'s default."""
    base = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return base.rstrip("/")


MODEL_TRAINING_VIEW = "?workflowType=machine_learning"
"""Opens the MLflow UI's model-training view. MLflow 3.17's UI shows every experiment in the
view of its global GenAI / Model training switch (remembered per browser, GenAI at first) and
ignores the experiment's mlflow.experimentKind tag; this URL parameter overrides the switch."""


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI address of a run, in the model-training view."""
    route = f"#/experiments/{experiment_id}/runs/{run_id}"
    return f"{ui_base(tracking_uri)}/{route}{MODEL_TRAINING_VIEW}"


def experiment_link(tracking_uri: str, experiment_id: str) -> str:
    """The MLflow UI address of an experiment's runs, in the model-training view."""
    return f"{ui_base(tracking_uri)}/#/experiments/{experiment_id}{MODEL_TRAINING_VIEW}"


def artifact_link(tracking_uri: str, run_id: str, path: str) -> str:
    """The MLflow server's address of one artifact file of a run (what the UI's preview loads)."""
    return f"{ui_base(tracking_uri)}/get-artifact?path={quote(path)}&run_uuid={run_id}"


def runs_and_plots_markdown(
    tracking_uri: str, experiment_id: str, stage_ids: dict[str, str]
) -> str:
    """A link per stage run and the evaluate run's headline plots, shown from MLflow."""
    lines = [
        "",
        "## MLflow runs",
        "",
        f"- experiment: {experiment_link(tracking_uri, experiment_id)}",
    ]
    for stage, run_id in stage_ids.items():
        link = run_link(tracking_uri, experiment_id, run_id)
        lines.append(f"- {stage}: [{run_id}]({link})")
    if "evaluate" in stage_ids:
        lines += ["", "## Plots", ""]
        for title, path in HEADLINE_PLOTS.items():
            lines.append(f"![{title}]({artifact_link(tracking_uri, stage_ids['evaluate'], path)})")
    return "\n".join(lines) + "\n"


def summary_markdown(
    name: str, link: str, dataset: DatasetRef, result: EvalResult, seconds: dict[str, float]
) -> str:
    """Key metrics, dataset hash, model version, champion decision and the MLflow link."""
    samples = sum(dataset.counts.values())
    lines = [
        f"# trainflow: {name}",
        "",
        "| | |",
        "|---|---|",
        f"| {result.headline.replace('_', ' ')} | **{result.headline_value:.4f}** |",
        *[
            f"| macro F1 | {v:.4f} |"
            for v in [result.metrics.get("test_macro_f1")]
            if v is not None
        ],
        f"| dataset hash | `{dataset.content_hash[:16]}` ({samples} samples) |",
        f"| model | `{result.model_uri or 'not logged'}` |",
        f"| registered version | {registered_text(result.registry)} |",
        f"| champion | {champion_text(result.registry)} |",
        f"| stage seconds | {', '.join(f'{k} {v:.1f}' for k, v in seconds.items())} |",
        f"| MLflow run | [{link}]({link}) |",
    ]
    return "\n".join(lines) + "\n"


def _macro_f1_line(result: EvalResult) -> list[str]:
    """The macro F1 row, for objectives that have one (classification)."""
    f1 = result.metrics.get("test_macro_f1")
    return [] if f1 is None else [f"| macro F1 | {f1:.4f} |"]


def registered_text(reg: RegistryResult | None) -> str:
    """`name` version N, with its URI; or why there is none."""
    if reg is None:
        return "not registered"
    return f"`{reg.name}` version **{reg.version}** (`models:/{reg.name}/{reg.version}`)"


def champion_text(reg: RegistryResult | None) -> str:
    """Whether this version took the alias (or which version keeps it), and why."""
    if reg is None:
        return "-"
    if reg.champion:
        return f"**yes**: `@{reg.alias}` moved here; {reg.reason}"
    return f"no: `@{reg.alias}` stays on version {reg.previous_version}; {reg.reason}"
