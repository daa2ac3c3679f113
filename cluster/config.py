"""Config of where the stages run: the dask cluster and the training executor."""

from typing import Literal

from pydantic import Field, model_validator

from tasks.base import StrictModel


class DaskConfig(StrictModel):
    """The dask cluster used by preprocessing."""

    address: str | None = None
    """Address of an existing scheduler (tcp://host:port); None starts a local cluster."""
    backend: Literal["auto", "gpu", "cpu"] = "auto"
    """auto: LocalCUDACluster + CuPy when a GPU is usable, else LocalCluster + NumPy."""
    n_workers: int = Field(2, ge=1, le=256)
    """Workers of a local CPU cluster (a CUDA cluster starts one per visible GPU)."""
    threads_per_worker: int = Field(1, ge=1, le=64)
    """Threads per local CPU worker."""
    memory_limit: str = "auto"
    """Memory limit per worker (dask syntax, e.g. '4GB'); 'auto' splits the host's memory."""


class ClusterConfig(StrictModel):
    """Where preprocessing and training run."""

    executor: Literal["local", "debug"] = "local"
    """local: submitit LocalExecutor, one process per rank; debug: in this process, 1 rank."""
    ranks_per_node: int = Field(2, ge=1, le=64)
    """DDP ranks (processes); on GPU machines each rank drives one GPU."""
    gpus_per_node: int = Field(0, ge=0, le=16)
    """GPUs for the job; 0 trains on CPU. Must be 0 or equal to ranks_per_node."""
    cpus_per_task: int = Field(1, ge=1, le=256)
    """CPU threads each rank may use (torch intra-op threads)."""
    timeout_min: int = Field(60, ge=1, le=60 * 24 * 14)
    """Wall-clock limit of the training job in minutes."""
    dask: DaskConfig = DaskConfig()
    """The dask cluster for preprocessing."""

    @model_validator(mode="after")
    def _check_resources(self) -> "ClusterConfig":
        if self.gpus_per_node not in (0, self.ranks_per_node):
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node} with ranks_per_node={self.ranks_per_node}: "
                "each rank drives exactly one GPU, so set gpus_per_node to 0 (CPU) or "
                f"{self.ranks_per_node}"
            )
        if self.executor == "debug" and self.ranks_per_node != 1:
            raise ValueError(
                "executor='debug' runs in this process with a single rank: "
                "set cluster.ranks_per_node=1 or use cluster.executor=local"
            )
        return self
