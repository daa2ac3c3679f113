"""What the train stage's MLflow run records of the checkpoint evaluation used."""

from mlflow.tracking import MlflowClient

from trainflow.tasks.train.ref import CheckpointRef


def log_checkpoint(client: MlflowClient, run_id: str, ref: CheckpointRef) -> None:
    """Best checkpoint facts as tags, so the run says which weights evaluation used."""
    client.set_tag(run_id, "best_checkpoint", str(ref.path))
    client.set_tag(run_id, "best_checkpoint_sha256", ref.sha256)
    client.set_tag(run_id, "best_epoch", str(ref.epoch))
    if ref.package_lock_hash:
        client.set_tag(run_id, "package_lock_hash", ref.package_lock_hash)
