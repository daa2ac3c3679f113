"""What each stage's MLflow run records about the references it produced."""

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.tracking.lineage import log_dataset_input
from trainflow.tasks.train.ref import CheckpointRef


def log_dataset(client: MlflowClient, run_id: str, ref: DatasetRef, cached: bool) -> None:
    """Dataset facts: hash and cache outcome as tags, counts as metrics, stats as params."""
    tags = {"dataset_hash": ref.content_hash, "cache": "hit" if cached else "miss"}
    params = {
        "dataset.path": str(ref.path),
        "dataset.shape": str(list(ref.shape)),
        "dataset.classes": ",".join(ref.classes)[:6000],
        "dataset.mean": str([round(m, 6) for m in ref.mean]),
        "dataset.std": str([round(s, 6) for s in ref.std]),
        "dataset.dtype": ref.sample_dtype,
        "dataset.normalisation": ref.normalisation,
        "dataset.target": f"{ref.target_dtype} {list(ref.target_shape)}",
        "dataset.num_classes": str(ref.n_classes),
    }
    metrics = [Metric(f"n_{split}", float(n), 0, 0) for split, n in ref.counts.items()]
    client.log_batch(
        run_id,
        metrics=metrics,
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    client.log_artifact(run_id, str(ref.path / "manifest.json"))
    log_dataset_input(client, run_id, ref, "preprocessed")


def log_checkpoint(client: MlflowClient, run_id: str, ref: CheckpointRef) -> None:
    """Best checkpoint facts as tags, so the run says which weights evaluation used."""
    client.set_tag(run_id, "best_checkpoint", str(ref.path))
    client.set_tag(run_id, "best_checkpoint_sha256", ref.sha256)
    client.set_tag(run_id, "best_epoch", str(ref.epoch))
    if ref.package_lock_hash:
        client.set_tag(run_id, "package_lock_hash", ref.package_lock_hash)
