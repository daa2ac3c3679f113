"""Lineage: which data, code, config and package set a run (and a registered model) came from.

The train and evaluate runs and the registered model version carry the same identity as tags
(``Lineage``); the dataset itself is each run's MLflow dataset input
(tasks.preprocess.mlflow_dataset).
"""

from dataclasses import dataclass


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
