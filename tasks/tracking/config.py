"""Config of MLflow tracking."""

from trainflow.tasks.base import StrictModel


class TrackingConfig(StrictModel):
    """Where runs are logged."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None: $MLFLOW_TRACKING_URI if set, else sqlite:///<workdir>/mlflow.db."""
    experiment: str = "trainflow"
    """MLflow experiment name."""
