"""Config of MLflow tracking."""

from pydantic import Field

from trainflow.tasks.base import StrictModel


class TrackingConfig(StrictModel):
    """Where runs are logged."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None: $MLFLOW_TRACKING_URI if set, else sqlite:///<workdir>/mlflow.db."""
    experiment: str = "trainflow"
    """MLflow experiment name."""
    system_metrics_interval_s: float = Field(10.0, ge=0.0, le=3600.0)
    """Seconds between samples of each node's CPU, memory and GPU use in the train run
    (MLflow's system metrics, one series per node); 0 turns them off."""
