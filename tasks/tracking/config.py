"""Config of MLflow tracking."""

from tasks.base import StrictModel


class TrackingConfig(StrictModel):
    """Where runs are logged."""

    tracking_uri: str | None = None
    """MLflow tracking URI; None: sqlite:///<workdir>/mlflow.db (a local store)."""
    experiment: str = "trainflow"
    """MLflow experiment name."""
