"""Lineage: which data, code, config and package set a run (and a registered model) came from.

Every stage run logs the dataset as an MLflow dataset input, so the run page's Datasets view
shows its name, digest (trainflow's content hash, cut to MLflow's 36 characters), source (the
shard folder), schema (shapes and dtypes) and profile (counts and classes). The train and
evaluate runs and the registered model version carry the same identity as tags (``Lineage``).
"""

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from mlflow.data.dataset import Dataset
from mlflow.data.schema import TensorDatasetSchema

# Made when mlflow.data.sources is imported (one class per artifact scheme): mypy cannot see it.
from mlflow.data.sources import LocalArtifactDatasetSource  # type: ignore[attr-defined]
from mlflow.entities import DatasetInput, InputTag
from mlflow.tracking import MlflowClient
from mlflow.types import Schema, TensorSpec

from trainflow.tasks.preprocess.ref import DatasetRef

DIGEST_CHARS = 32
"""MLflow stores at most 36 characters of a dataset digest: the content hash's first 32 (the
profile holds all of it)."""
CONTEXT_TAG = "mlflow.data.context"
"""The input tag the MLflow UI shows next to a dataset (training, evaluation, ...)."""


@dataclass(frozen=True)
class Lineage:
    """Where a model comes from: data, code, config and the package set its ranks ran."""

    dataset_hash: str
    """trainflow's content hash of the dataset (its start is the dataset input's digest)."""
    git_commit: str
    """The code's git commit (-dirty when the tree had changes)."""
    config_hash: str
    """Hash of the whole pipeline config."""
    package_lock_hash: str | None = None
    """sha256 of the installed distributions and versions as rank 0 saw them (None: unknown)."""
    code_snapshot_hash: str | None = None
    """Hash of the snapshot of the user's code the job imported (cluster.snapshot)."""

    def tags(self) -> dict[str, str]:
        """The lineage as run and model-version tags (unknown parts left out)."""
        tags = {
            "dataset_hash": self.dataset_hash,
            "git_commit": self.git_commit,
            "config_hash": self.config_hash,
        }
        if self.package_lock_hash:
            tags["package_lock_hash"] = self.package_lock_hash
        if self.code_snapshot_hash:
            tags["code_snapshot_hash"] = self.code_snapshot_hash
        return tags


class TrainflowDataset(Dataset):
    """A preprocessed dataset as MLflow's dataset view shows it (metadata only: no rows)."""

    def __init__(self, ref: DatasetRef, name: str | None = None) -> None:
        self._ref = ref
        source = LocalArtifactDatasetSource(str(ref.path))
        super().__init__(source, name=name or ref.path.name, digest=dataset_digest(ref))

    def _compute_digest(self) -> str:
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
    entity = TrainflowDataset(ref)._to_mlflow_entity()
    inputs = [DatasetInput(entity, tags=[InputTag(CONTEXT_TAG, context)])]
    client.log_inputs(run_id, datasets=inputs)
