"""The evaluation stage: best checkpoint -> test metrics, plots, a logged and registered model."""

import json
import time
from pathlib import Path

import numpy as np
import torch
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict

from trainflow.tasks.errors import DataError
from trainflow.tasks.evaluate import metrics
from trainflow.tasks.evaluate.config import EvaluateConfig
from trainflow.tasks.evaluate.predict import confusion_streamed
from trainflow.tasks.evaluate.registry import RegistryResult, register_and_promote
from trainflow.tasks.hashing import sha256_file
from trainflow.tasks.preprocess.ref import DatasetRef, dataset_spec
from trainflow.tasks.train.checkpoint import load_state
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.ref import CheckpointRef


class EvalResult(BaseModel):
    """What evaluation hands back to the flow."""

    model_config = ConfigDict(frozen=True)

    test_accuracy: float
    """Share of the test split classified correctly."""
    metrics: dict[str, float]
    """All logged test metrics (accuracy, macro F1, per-class precision/recall/F1)."""
    model_uri: str | None
    """URI of the logged MLflow model (None when model logging is off)."""
    registry: RegistryResult | None = None
    """The registered version and the champion decision (None: not registered)."""


def load_model(ckpt: CheckpointRef, train: TrainConfig, dataset: DatasetRef) -> torch.nn.Module:
    """Rebuild the model and load the best weights safely (hash checked, weights only)."""
    if sha256_file(ckpt.path) != ckpt.sha256:
        raise DataError(f"checkpoint {ckpt.path} does not match its recorded sha256")
    model = build_model(train, dataset_spec(dataset))
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
) -> EvalResult:
    """Evaluate the best checkpoint on the test split and log everything to ``run_id``.

    With registration on, the logged model becomes a new registered version tagged with
    ``version_tags`` (dataset_hash, git_commit, config_hash) and may take the champion alias.
    """
    model = load_model(ckpt, train, dataset)
    cm, example = confusion_streamed(model, dataset, cfg.batch_size)  # the split streams
    report = metrics.per_class_report(cm, dataset.classes)
    flat = metrics.flat_metrics(cm, report)
    client = MlflowClient(tracking_uri)
    _log_results(client, run_id, cm, report, flat, dataset.classes, ckpt.history_path)
    from trainflow.tasks.evaluate.model_logging import (
        log_model,  # torch.export, MLflow's flavor: lazy
    )

    uri = log_model(model, example, tracking_uri, run_id) if cfg.log_model else None
    registry = _register(client, cfg, uri, run_id, flat, version_tags) if uri else None
    return EvalResult(
        test_accuracy=flat["test_accuracy"], metrics=flat, model_uri=uri, registry=registry
    )


def _register(
    client: MlflowClient,
    cfg: EvaluateConfig,
    model_uri: str,
    run_id: str,
    flat: dict[str, float],
    version_tags: dict[str, str],
) -> RegistryResult | None:
    """A new registered version that takes the champion alias if it wins (None: off)."""
    if cfg.registered_model is None:
        return None
    metric = cfg.champion_metric
    return register_and_promote(
        client,
        model_uri,
        cfg.registered_model,
        run_id,
        metric,
        flat[metric],
        version_tags,
        cfg.champion_alias,
    )


def _log_results(
    client: MlflowClient,
    run_id: str,
    cm: np.ndarray,
    report: dict[str, metrics.ClassReport],
    flat: dict[str, float],
    classes: list[str],
    history_path: Path,
) -> None:
    from trainflow.tasks.evaluate import plots  # matplotlib: imported when figures are drawn

    ts = int(1000 * time.time())
    client.log_batch(run_id, metrics=[Metric(k, v, ts, 0) for k, v in flat.items()])
    client.log_dict(run_id, {"classes": classes, "matrix": cm.tolist()}, "confusion_matrix.json")
    client.log_dict(run_id, {k: r.model_dump() for k, r in report.items()}, "per_class.json")
    fig = plots.confusion_figure(cm, classes)
    client.log_figure(run_id, fig, "confusion_matrix.png")
    plots.close(fig)
    history = json.loads(history_path.read_text())
    fig = plots.curves_figure(history)
    client.log_figure(run_id, fig, "training_curves.png")
    plots.close(fig)
