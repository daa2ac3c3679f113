"""The evaluation stage: best checkpoint -> test metrics, plots, a logged and registered model
(a transformers model also as a save_pretrained folder)."""

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict

from trainflow.cluster.snapshot import code_path
from trainflow.errors import ConfigError, DataError
from trainflow.tasks.evaluate.config import EvaluateConfig
from trainflow.tasks.evaluate.hf_export import log_pretrained
from trainflow.tasks.evaluate.naming import AUTO, default_name
from trainflow.tasks.evaluate.predict import test_batches
from trainflow.tasks.evaluate.registry import RegistryResult, register_and_promote
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.objectives import Objective, Report, make_objective
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.checkpointing.checkpoint import load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.ref import CheckpointRef


class EvalResult(BaseModel):
    """What evaluation hands back to the flow."""

    model_config = ConfigDict(frozen=True)

    headline: str
    """The objective's headline test metric: test_accuracy, test_r2, test_perplexity..."""
    headline_value: float
    """Its value."""
    metrics: dict[str, float]
    """All logged test metrics (classification: accuracy, macro F1, per-class
    precision/recall/F1; regression: loss, MAE, RMSE, R²; sequence: loss, token accuracy,
    perplexity)."""
    model_uri: str | None
    """URI of the logged MLflow model (None when model logging is off)."""
    registry: RegistryResult | None = None
    """The registered version and the champion decision (None: not registered)."""

    @property
    def test_accuracy(self) -> float:
        """Test accuracy (classification runs; NaN for other objectives)."""
        return self.metrics.get("test_accuracy", float("nan"))


def load_model(ckpt: CheckpointRef, train: TrainConfig, dataset: DatasetRef) -> torch.nn.Module:
    """Rebuild the model and load the best weights safely (hash checked, weights only)."""
    if sha256_file(ckpt.path) != ckpt.sha256:
        raise DataError(f"checkpoint {ckpt.path} does not match its recorded sha256")
    model = build_model(train, dataset_spec(dataset, train.objective))
    model.load_state_dict(load_state(ckpt.path)["model"])
    return model.eval()


def run_evaluate(
    cfg: EvaluateConfig,
    train: TrainConfig,
    dataset: DatasetRef,
    ckpt: CheckpointRef,
    tracking_uri: str,
    run_id: str,
    version_tags: dict[str, str],
    say: Callable[[str], object] = lambda line: None,
    code: Sequence[Path] = (),
) -> EvalResult:
    """Evaluate the best checkpoint on the test split and log everything to ``run_id``;
    `say` gets the headline metric as soon as the test pass gives it (the run's first result:
    plots, the model's export and registration follow). `code`: the run's code snapshot
    folders, where the user's modules are imported from (cluster.snapshot).

    With registration on, the logged model becomes a new registered version tagged with
    ``version_tags`` (dataset_hash, git_commit, config_hash) and may take the champion alias.
    """
    with code_path(code):
        model = load_model(ckpt, train, dataset)
    objective = make_objective(
        train.objective, dataset_spec(dataset, train.objective), train.objective_args
    )
    example: list[np.ndarray] = []
    batches = test_batches(model, dataset, cfg.batch_size, example)  # the split streams
    report = objective.report(batches, dataset.classes)
    headline = f"test_{objective.headline}"
    say(_headline_line(headline, report.metrics[headline], ckpt.test_metrics.get(headline)))
    client = MlflowClient(tracking_uri)
    _log_results(client, run_id, report, objective, ckpt.history_path)
    uri = None
    if cfg.log_model:
        from trainflow.tasks.evaluate.model_logging import log_model  # torch.export: lazy

        uri = log_model(model, example[0], tracking_uri, run_id)
        log_pretrained(client, run_id, model, train.model_args)
    flat = report.metrics
    name = default_name(train, model) if cfg.registered_model == AUTO else cfg.registered_model
    registry = None
    if uri and name is not None:
        registry = _register(client, cfg, name, uri, run_id, flat, objective, version_tags)
    return EvalResult(
        headline=headline,
        headline_value=flat[headline],
        metrics=flat,
        model_uri=uri,
        registry=registry,
    )


def _headline_line(headline: str, value: float, job_value: float | None) -> str:
    """The test pass's headline line: the run's first result, unless the job gave it."""
    follow = "plots, the model's export and its registration follow"
    words = headline.replace("_", " ")
    if job_value is None:
        return f"{words} {value:.4f} (first result; {follow})"
    return f"{words} {value:.4f} (the training job's test pass: {job_value:.4f}; {follow})"


def _register(
    client: MlflowClient,
    cfg: EvaluateConfig,
    name: str,
    model_uri: str,
    run_id: str,
    flat: dict[str, float],
    objective: Objective,
    version_tags: dict[str, str],
) -> RegistryResult:
    """A new version of the registered model `name` that takes the champion alias if it wins."""
    metric = cfg.champion_metric or f"test_{objective.headline}"
    if metric not in flat:
        raise ConfigError(
            f"evaluate.champion_metric={metric!r} is not a test metric of train.objective: "
            f"use one of {sorted(k for k in flat if '_' not in k.removeprefix('test_'))}"
        )
    return register_and_promote(
        client,
        model_uri,
        name,
        run_id,
        metric,
        flat[metric],
        version_tags,
        cfg.champion_alias,
        higher_is_better=objective.higher_is_better(metric),
    )


def _log_results(
    client: MlflowClient, run_id: str, report: Report, objective: Objective, history_path: Path
) -> None:
    """The report's metrics, documents and figures, and the training curves."""
    from trainflow.tasks.objectives import plots  # matplotlib: imported when figures are drawn

    ts = int(1000 * time.time())
    client.log_batch(run_id, metrics=[Metric(k, v, ts, 0) for k, v in report.metrics.items()])
    for name, content in report.documents.items():
        client.log_dict(run_id, content, name)
    for name, fig in report.figures.items():
        client.log_figure(run_id, fig, name)
        plots.close(fig)
    history = json.loads(history_path.read_text())
    second = objective.headline if objective.headline != "loss" else objective.select
    fig = plots.curves_figure(history, second)
    client.log_figure(run_id, fig, "training_curves.png")
    plots.close(fig)
