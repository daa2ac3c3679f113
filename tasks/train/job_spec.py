"""What a training job is given: small and picklable, it travels to the cluster."""

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.config import TrainConfig


class TrainJobSpec(BaseModel):
    """Everything a training job needs; small and picklable (it travels to the cluster)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    train: TrainConfig
    """What to train and how."""
    dataset: DatasetRef
    """The preprocessed dataset to train on."""
    out_dir: Path
    """Folder of this run's checkpoints/, best.pt and history.json (reused on resume)."""
    cpus_per_task: int = Field(1, ge=1)
    """torch threads per rank."""
    tracking_uri: str | None = None
    """MLflow tracking URI; with run_id, rank 0 logs per-epoch metrics there."""
    run_id: str | None = None
    """MLflow run to log into (created by the flow, continued on resume)."""
    code: list[Path] = []
    """Folders of the run's snapshot of the user's code (cluster.snapshot): every rank of
    every attempt puts them first on sys.path before it builds the model."""
    system_metrics_interval_s: float = Field(0.0, ge=0.0)
    """With a run: seconds between system metrics samples of each node; 0: none."""
    signal_delay_s: int = Field(0, ge=0)
    """Seconds before a Slurm time limit that the requeue signal comes (cluster.signal_delay_s):
    such a signal is the limit's, held by rank 0 until its own planned checkpoint; one earlier
    is a preemption's (the local executor's delay is read from its environment)."""
    max_requeues: int = Field(3, ge=0)
    """Attempts in a row that reach a time limit without a new checkpoint before the job
    fails (cluster.max_requeues); attempts that made progress do not count."""

    @property
    def checkpoint_dir(self) -> Path:
        """Where the full training state is written (out_dir/checkpoints)."""
        return self.out_dir / "checkpoints"
