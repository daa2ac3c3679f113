"""Config of where the stages run: the dask cluster and the training executor."""

from typing import Literal

from pydantic import Field, model_validator

from trainflow.cluster.job_environment import ContainerConfig, check_setup_lines
from trainflow.config_base import StrictModel

# sbatch options trainflow sets itself from the fields above (or submitit needs): an
# sbatch_extra entry for one of them would silently contradict the validated request.
RESERVED_SBATCH_OPTIONS = {
    "nodes": "cluster.nodes",
    "ntasks": "cluster.ranks_per_node",
    "ntasks_per_node": "cluster.ranks_per_node",
    "gpus": "cluster.gpus_per_node",
    "gpus_per_node": "cluster.gpus_per_node",
    "gpus_per_task": "cluster.gpus_per_node",
    "gres": "cluster.gpus_per_node",
    "cpus_per_task": "cluster.cpus_per_task",
    "mem": "cluster.mem_gb",
    "mem_per_cpu": "cluster.mem_gb",
    "mem_per_gpu": "cluster.mem_gb",
    "time": "cluster.timeout_min",
    "partition": "cluster.partition",
    "account": "cluster.account",
    "qos": "cluster.qos",
    "signal": "cluster.signal_delay_s",
    "no_requeue": "cluster.max_requeues",
    "array": "(set by trainflow)",
    "output": "(set by trainflow)",
    "error": "(set by trainflow)",
    "open_mode": "(set by trainflow)",
}

# The same for the dask worker jobs (cluster.dask.sbatch_extra).
DASK_SBATCH_OPTIONS = {
    "nodes": "(one node per worker job)",
    "ntasks": "(one task per worker job)",
    "ntasks_per_node": "(one task per worker job)",
    "gpus": "cluster.dask.gpus_per_worker",
    "gpus_per_node": "cluster.dask.gpus_per_worker",
    "gpus_per_task": "cluster.dask.gpus_per_worker",
    "gres": "cluster.dask.gpus_per_worker",
    "cpus_per_task": "cluster.dask.cpus_per_worker",
    "mem": "cluster.dask.mem_gb",
    "mem_per_cpu": "cluster.dask.mem_gb",
    "mem_per_gpu": "cluster.dask.mem_gb",
    "time": "cluster.dask.timeout_min",
    "partition": "cluster.dask.partition",
    "account": "cluster.dask.account",
    "job_name": "(set by trainflow)",
    "output": "(set by trainflow)",
    "error": "(set by trainflow)",
}


class DaskConfig(StrictModel):
    """The dask cluster used by preprocessing."""

    address: str | None = None
    """Address of an existing scheduler (tcp://host:port); None starts a local cluster."""
    backend: Literal["auto", "gpu", "cpu"] = "auto"
    """auto: LocalCUDACluster + CuPy when a GPU is usable, else LocalCluster + NumPy."""
    n_workers: int = Field(2, ge=1, le=256)
    """Workers of a local CPU cluster (a CUDA cluster starts one per visible GPU); with
    executor=slurm, worker jobs queued."""
    threads_per_worker: int = Field(1, ge=1, le=64)
    """Threads per local CPU worker."""
    memory_limit: str = "auto"
    """Memory limit per local worker (dask syntax, e.g. '4GB'); 'auto' splits the host's memory.
    Slurm workers take mem_gb instead."""
    local_workers: Literal["auto", "processes", "threads"] = "auto"
    """How a local CPU cluster runs. processes: n_workers Python processes (parallel work that
    holds the GIL, memory_limit per worker, a lost worker restarted alone); threads: one worker
    of n_workers x threads_per_worker threads inside the flow's process, ready at once (each
    worker process costs ~1.5 CPU s of imports and ~1 s before its first task on 2 cores);
    auto: threads for an array dataset (synthetic, mnist, npz) known to be under 64 MiB (the
    tiny and demo presets) with memory_limit 'auto'; else processes (image folders, which
    decode to more than their files, and plug-ins, whose code stays out of the flow's
    process). Only for a local cluster (no address, executor local); a CUDA cluster, where one
    starts, is always one process per GPU."""
    executor: Literal["local", "slurm", "allocation"] = "local"
    """local: workers on this machine (or at `address`); slurm: one Slurm job per worker
    (dask-jobqueue), the scheduler in the flow's process; allocation: the workers as one srun
    step over the nodes of the Slurm job the flow runs in (deploy/slurm/pipeline.sbatch). The
    fields below are Slurm's (allocation uses cpus/gpus_per_worker, mem_gb, start_timeout_s)."""
    partition: str | None = None
    """Slurm partition of the worker jobs; None: the cluster's default partition."""
    account: str | None = None
    """Slurm account charged for the worker jobs; None: the user's default."""
    timeout_min: int = Field(60, ge=1, le=60 * 24 * 14)
    """Wall-clock limit of each worker job in minutes: cover the whole preprocessing."""
    mem_gb: float = Field(4.0, gt=0)
    """Memory of each worker job in GiB (sbatch --mem), also the worker's dask memory limit."""
    cpus_per_worker: int = Field(1, ge=1, le=256)
    """CPUs of each worker job (sbatch --cpus-per-task); the worker runs threads_per_worker."""
    gpus_per_worker: int = Field(0, ge=0, le=16)
    """GPUs of each worker job (--gres=gpu:N); above 0 the job runs dask-cuda-worker (one
    worker per GPU, CuPy arrays), 0 a plain dask worker (NumPy)."""
    start_timeout_s: int = Field(300, ge=1, le=24 * 3600)
    """How long to wait for all n_workers to connect before failing with squeue's reason."""
    scheduler_host: str | None = None
    """Address the scheduler listens on, reachable from the compute nodes; None: this host's
    name resolved (on many clusters set the login node's cluster-network address)."""
    sbatch_extra: dict[str, str] = Field(default_factory=dict)
    """Extra sbatch options of the worker jobs by long name without dashes, e.g.
    {"constraint": "a100"}; options set from the fields above are refused here."""

    @model_validator(mode="after")
    def _check_executor(self) -> "DaskConfig":
        if self.executor != "local":
            _check_slurm_workers(self)
        if self.local_workers == "threads" and (self.executor != "local" or self.address):
            raise ValueError(
                "cluster.dask.local_workers='threads' runs a local cluster in this process, but "
                + (f"cluster.dask.executor={self.executor!r}" if self.executor != "local"
                   else f"cluster.dask.address={self.address!r}")
                + " names workers elsewhere: set local_workers='auto', or executor='local' "
                "with no address"
            )  # fmt: skip
        for key in self.sbatch_extra:
            _check_sbatch_key(key, DASK_SBATCH_OPTIONS)
        return self


class ClusterConfig(StrictModel):
    """Where preprocessing and training run."""

    executor: Literal["local", "debug", "slurm", "allocation"] = "local"
    """local: submitit LocalExecutor, one process per rank; debug: in this process, 1 rank;
    slurm: an sbatch job on the Slurm cluster this machine submits to; allocation: one srun
    step over the nodes of the Slurm job the flow runs in (deploy/slurm/pipeline.sbatch)."""
    nodes: int = Field(1, ge=1, le=1024)
    """Nodes of the training job (more than 1 only with executor=slurm or allocation)."""
    ranks_per_node: int = Field(2, ge=1, le=64)
    """DDP ranks (processes) per node; on GPU machines each rank drives one GPU."""
    gpus_per_node: int = Field(0, ge=0, le=16)
    """GPUs per node for the job; 0 trains on CPU. Must be 0 or equal to ranks_per_node."""
    cpus_per_task: int = Field(1, ge=1, le=256)
    """CPU threads each rank may use (torch intra-op threads)."""
    timeout_min: int = Field(60, ge=1, le=60 * 24 * 14)
    """Wall-clock limit of the training job in minutes (each Slurm requeue gets it anew)."""
    partition: str | None = None
    """Slurm partition; None: the cluster's default partition. Ignored by local/debug."""
    account: str | None = None
    """Slurm account charged for the job; None: the user's default. Ignored by local/debug."""
    qos: str | None = None
    """Slurm quality of service; None: the account's default. Ignored by local/debug."""
    mem_gb: float | None = Field(None, gt=0)
    """Memory per node in GiB (sbatch --mem); None: the partition's default."""
    sbatch_extra: dict[str, str] = Field(default_factory=dict)
    """Extra sbatch options by long name without dashes, e.g. {"constraint": "a100"}; options
    trainflow sets from the fields above are refused here."""
    signal_delay_s: int = Field(90, ge=1, le=3600)
    """Slurm sends SIGUSR2 this many seconds before the time limit: time to checkpoint (Slurm
    checks limits about every 30 s, so the signal may come up to that much later)."""
    peer_timeout_s: int = Field(60, ge=10, le=3600)
    """How long a rank waits in a collective for a silent peer before the job fails (torch's
    process-group timeout, 30 min by default, set here for every rank through
    cluster.rank_guard). A killed rank's peers fail at once on the closed connection; this bounds
    the case where a peer's node is gone without closing it. Raise it if a rank can be busy alone
    for longer (e.g. a slow checkpoint write while its peers wait)."""
    max_restarts: int = Field(1, ge=0, le=20)
    """How often a job that lost a rank (killed, or its node gone) is submitted again from its
    last checkpoint, in the same MLflow run; on Slurm away from the lost node when the other
    nodes can hold the job. A rank that raises is never restarted."""
    max_requeues: int = Field(3, ge=0, le=100)
    """How many attempts in a row may reach their time limit without a new checkpoint before
    the training job fails instead of requeueing again. Attempts that checkpointed progress
    and preemptions do not count: a job runs to its end across as many time limits as it
    needs."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines the Slurm training job runs before it starts its ranks, in order, e.g.
    ["module load cuda/12.4", "source /shared/envs/train/bin/activate"] (executor=slurm)."""
    container: ContainerConfig | None = None
    """An image every rank of the Slurm training job runs in (Apptainer, Singularity or
    Pyxis; executor=slurm); None: the ranks run in the submitting environment's Python."""
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
        if self.executor not in ("slurm", "allocation") and self.nodes != 1:
            raise ValueError(
                f"nodes={self.nodes} with executor='{self.executor}': only Slurm spans "
                "several nodes; set cluster.nodes=1 or cluster.executor=slurm (or allocation "
                "inside a multi-node Slurm job)"
            )
        return self

    @model_validator(mode="after")
    def _check_slurm_options(self) -> "ClusterConfig":
        if self.executor == "slurm" and self.signal_delay_s >= self.timeout_min * 60:
            raise ValueError(
                f"signal_delay_s={self.signal_delay_s} is not below timeout_min="
                f"{self.timeout_min} (in seconds: {self.timeout_min * 60}): the job would be "
                "told to checkpoint as it starts; lower cluster.signal_delay_s or raise "
                "cluster.timeout_min"
            )
        for key in self.sbatch_extra:
            _check_sbatch_key(key)
        check_setup_lines(self.setup)
        if (self.setup or self.container) and self.executor != "slurm":
            key = "cluster.setup" if self.setup else "cluster.container"
            raise ValueError(
                f"{key} applies to the Slurm job script, but executor={self.executor!r} starts "
                "ranks in this environment: use executor='slurm', or leave it out here (in an "
                "allocation, put those lines in your sbatch script before `trainflow run`)"
            )
        return self


def _check_slurm_workers(cfg: DaskConfig) -> None:
    """ValueError for DaskConfig fields that contradict executor='slurm'."""
    if cfg.address:
        raise ValueError(
            f"cluster.dask.executor={cfg.executor!r} starts its own scheduler, but "
            f"cluster.dask.address={cfg.address!r} names one: unset cluster.dask.address or set "
            "executor='local'"
        )
    if cfg.threads_per_worker > cfg.cpus_per_worker:
        raise ValueError(
            f"cluster.dask.threads_per_worker={cfg.threads_per_worker} exceeds "
            f"cluster.dask.cpus_per_worker={cfg.cpus_per_worker}: raise cpus_per_worker or "
            "lower threads_per_worker"
        )
    if cfg.backend == "gpu" and cfg.gpus_per_worker == 0:
        raise ValueError(
            f"cluster.dask.backend='gpu' with executor={cfg.executor!r} needs GPU workers: set "
            "cluster.dask.gpus_per_worker>=1 (or backend='auto')"
        )
    if cfg.backend == "cpu" and cfg.gpus_per_worker > 0:
        raise ValueError(
            f"cluster.dask.backend='cpu' with gpus_per_worker={cfg.gpus_per_worker}: set "
            "gpus_per_worker=0 for CPU workers or backend='auto'"
        )


def _check_sbatch_key(key: str, reserved: dict[str, str] = RESERVED_SBATCH_OPTIONS) -> None:
    """ValueError for an sbatch_extra key that is malformed or reserved by trainflow."""
    name = key.replace("-", "_")
    if len(name) < 2 or not name.replace("_", "").isalnum() or name.startswith("_"):
        raise ValueError(
            f"sbatch_extra key {key!r}: use sbatch's long option name without leading dashes, "
            "e.g. 'constraint' for --constraint"
        )
    if name in reserved:
        raise ValueError(
            f"sbatch_extra key {key!r} is set by trainflow itself: use "
            f"{reserved[name]} instead (reserved: {', '.join(sorted(reserved))})"
        )
