"""The pipeline run's summary as Markdown, for the Prefect UI's artifact tab."""

from trainflow.tasks.evaluate.registry import RegistryResult
from trainflow.tasks.evaluate.run import EvalResult
from trainflow.tasks.preprocess.ref import DatasetRef


def run_link(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI address of a run: the tracking server's, or `trainflow ui`'s default."""
    base = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


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
