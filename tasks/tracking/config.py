"""Config of MLflow tracking (and where it resolves to: no MLflow import here)."""

import os
from pathlib import Path

from pydantic import Field

from trainflow.config_base import StrictModel


class TrackingConfig(StrictModel):
    """Where runs are logged."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None: $MLFLOW_TRACKING_URI if set, else sqlite:///<workdir>/mlflow.db."""
    experiment: str = "trainflow"
    """MLflow experiment name."""
    system_metrics_interval_s: float = Field(10.0, ge=0.0, le=3600.0)
    """Seconds between samples of each node's CPU, memory and GPU use in the train run
    (MLflow's system metrics, one series per node); 0 turns them off."""


def resolve_tracking_uri(cfg: TrackingConfig, workdir: Path) -> str:
    """The configured URI, else MLFLOW_TRACKING_URI, else a SQLite store in the working folder.

    Honouring MLflow's own variable lets a deployment or an sbatch script point every run at a
    tracking server without touching the config.
    """
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(workdir / 'mlflow.db').resolve()}"
