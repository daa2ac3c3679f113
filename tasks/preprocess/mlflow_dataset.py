"""What an MLflow run records of a preprocessed dataset: its facts, and the dataset input.

Every stage run logs the dataset as an MLflow dataset input, so the run page's Datasets view
shows its name, digest (trainflow's content hash, cut to MLflow's 36 characters), source (the
shard folder), schema (shapes and dtypes) and profile (counts and classes). It lives with the
DatasetRef it reads: tasks.tracking stays below the stages (tests/unit/test_layering.py).
"""

import json
from typing import Any

import numpy as np
from mlflow.data.dataset import Dataset
from mlflow.data.schema import TensorDatasetSchema

# Made when mlflow.data.sources is imported (one class per artifact scheme): mypy cannot see it.
from mlflow.data.sources import LocalArtifactDatasetSource  # type: ignore[attr-defined]
from mlflow.entities import Dataset as DatasetEntity
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from mlflow.types import Schema, TensorSpec

from trainflow.tasks.preprocess.ref import DatasetRef

DIGEST_CHARS = 32
"""MLflow stores at most 36 characters of a dataset digest: the content hash's first 32 (the
profile holds all of it)."""
CONTEXT_TAG = "mlflow.data.context"
"""The input tag the MLflow UI shows next to a dataset (training, evaluation, ...)."""


class TrainflowDataset(Dataset):
    """A preprocessed dataset as MLflow's dataset view shows it (metadata only: no rows)."""

    def __init__(self, ref: DatasetRef, name: str | None = None) -> None:
        self._ref = ref
        source = LocalArtifactDatasetSource(str(ref.path))
        super().__init__(source, name=name or ref.path.name, digest=dataset_digest(ref))

    def _compute_digest(self) -> str:
        # The abstract method every mlflow.data Dataset subclass implements (its digest when
        # none is given): MLflow's extension interface, not an internal.
        return dataset_digest(self._ref)

    @property
    def profile(self) -> dict[str, Any]:
        """Samples per split, their total, the classes and the whole content hash."""
        ref, counts = self._ref, dict(self._ref.counts)
        total = {"num_samples": sum(counts.values()), **counts}
        return {**total, "classes": list(ref.classes), "content_hash": ref.content_hash}

    @property
    def schema(self) -> TensorDatasetSchema:
        """One sample's shape and dtype (batch dimension -1) and the target's."""
        ref = self._ref  # the dtypes the shards hold (uint8 pixels, float32, int64 token ids)
        sample = TensorSpec(np.dtype(ref.sample_dtype), (-1, *ref.shape), "x")
        target = TensorSpec(np.dtype(ref.target_dtype), (-1, *ref.target_shape), "y")
        return TensorDatasetSchema(features=Schema([sample]), targets=Schema([target]))

    def to_dict(self) -> dict[str, str]:
        """Name, digest, source, schema and profile as MLflow stores them."""
        return {
            **super().to_dict(),
            "schema": json.dumps(self.schema.to_dict()),
            "profile": json.dumps(self.profile),
        }


def dataset_digest(ref: DatasetRef) -> str:
    """The dataset input's digest: the start of trainflow's content hash."""
    return ref.content_hash[:DIGEST_CHARS]


def log_dataset_input(client: MlflowClient, run_id: str, ref: DatasetRef, context: str) -> None:
    """Log `ref` as a dataset input of the run, tagged with its context (e.g. training)."""
    fields = TrainflowDataset(ref).to_dict()  # the public form of what the run stores
    entity = DatasetEntity(
        name=fields["name"],
        digest=fields["digest"],
        source_type=fields["source_type"],
        source=fields["source"],
        schema=fields["schema"],
        profile=fields["profile"],
    )
    inputs = [DatasetInput(entity, tags=[InputTag(CONTEXT_TAG, context)])]
    client.log_inputs(run_id, datasets=inputs)


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
