"""cluster.dask.executor=slurm without Slurm: config validation, the check of a worker request
against given cluster facts, and the job script dask-jobqueue writes from our options."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainflow.cluster.config import DaskConfig
from trainflow.cluster.dask import dask_client
from trainflow.cluster.dask_slurm import cluster_options, slurm_time
from trainflow.cluster.dask_slurm_checks import check_workers_against
from trainflow.cluster.dask_srun import srun_argv
from trainflow.cluster.slurm_checks import Node, Partition
from trainflow.compat import import_slurm_cluster
from trainflow.errors import ConfigError

_PARTS = [
    Partition("cpu", True, 2, None, 60, None, None),
    Partition("gpu", False, 1, None, None, None, None),
]
_NODES = [
    Node("n1", cpus=4, mem_mb=8000, gpus=0, partitions=("cpu",)),
    Node("n2", cpus=8, mem_mb=4000, gpus=0, partitions=("cpu",)),
    Node("g1", cpus=8, mem_mb=16000, gpus=2, partitions=("gpu",)),
]


def _slurm(**kw: object) -> DaskConfig:
    return DaskConfig.model_validate({"executor": "slurm", "timeout_min": 30, **kw})


def test_local_stays_the_default() -> None:
    assert DaskConfig().executor == "local"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"address": "tcp://h:1"}, "unset cluster.dask.address"),
        ({"threads_per_worker": 4}, "threads_per_worker=4 exceeds"),
        ({"backend": "gpu"}, "gpus_per_worker>=1"),
        ({"backend": "cpu", "gpus_per_worker": 1}, "set gpus_per_worker=0"),
        ({"sbatch_extra": {"mem": "4G"}}, "use cluster.dask.mem_gb instead"),
    ],
)
def test_contradictions_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _slurm(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"partition": "nope"}, "no such partition .* one of: cpu, gpu"),
        ({"timeout_min": 61}, "MaxTime 60 min: set cluster.dask.timeout_min<=60"),
        ({"cpus_per_worker": 9}, "cpus_per_worker=9, but .* offers 8 CPUs"),
        ({"mem_gb": 8}, r"mem_gb=8.0 \(8192 MiB per worker\), but .* offers 8000 MiB"),
        ({"gpus_per_worker": 1}, "partition 'cpu' has 0 GPU"),
        ({"cpus_per_worker": 8, "mem_gb": 5}, "no node of partition 'cpu' offers 8 CPUs"),
    ],
)
def test_requests_no_node_can_hold_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_workers_against(_slurm(**fields), _PARTS, _NODES)


def test_requests_that_fit_pass() -> None:
    check_workers_against(_slurm(cpus_per_worker=8, mem_gb=3), _PARTS, _NODES)
    check_workers_against(_slurm(partition="gpu", gpus_per_worker=2), _PARTS, _NODES)


def _script(cfg: DaskConfig) -> str:
    opts = cluster_options(cfg, "trainflow-dask-x", Path("/logs"), {"A_VAR": 1})
    for key in ("scheduler_options", "silence_logs"):  # the cluster's, not the job's
        opts.pop(key)
    job_cls = import_slurm_cluster().job_cls
    return str(job_cls(scheduler="tcp://10.0.0.1:8786", name="w0", **opts).job_script())


def test_the_job_script_carries_every_field() -> None:
    cfg = _slurm(partition="p", account="acc", cpus_per_worker=3, mem_gb=1.5, timeout_min=90)
    script = _script(cfg)
    for line in ("-J trainflow-dask-x", "-p p", "-A acc", "--cpus-per-task=3", "--mem=1536M"):
        assert f"#SBATCH {line}\n" in script
    assert "#SBATCH -t 0-01:30:00" in script
    assert "export A_VAR=1" in script
    assert "-m distributed.cli.dask_worker tcp://10.0.0.1:8786" in script
    assert "--gres" not in script


def test_gpu_workers_run_dask_cuda_worker_with_their_gpus() -> None:
    script = _script(_slurm(gpus_per_worker=2, sbatch_extra={"constraint": "a100"}))
    assert "#SBATCH --gres=gpu:2" in script
    assert "#SBATCH --constraint=a100" in script
    assert "-m dask_cuda.cli tcp://10.0.0.1:8786" in script


def test_slurm_time() -> None:
    assert [slurm_time(m) for m in (1, 90, 1440 + 61)] == ["0-00:01:00", "0-01:30:00", "1-01:01:00"]


def test_allocation_workers_need_a_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = DaskConfig(executor="allocation")
    refused = r"runs in none \(no SLURM_JOB_ID\).*dask.executor=slurm or local"
    with pytest.raises(ConfigError, match=refused), dask_client(cfg, tmp_path):
        pass


def test_allocation_step_spreads_the_workers_over_the_jobs_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    cfg = DaskConfig(executor="allocation", n_workers=3, cpus_per_worker=2, mem_gb=1)
    argv = srun_argv(cfg, "tcp://10.0.0.1:1", "trainflow-dask-x", Path("/logs"))
    assert argv[:7] == [
        "srun",
        "--job-name=trainflow-dask-x",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--nodes=2",
        "--ntasks=3",
        "--cpus-per-task=2",
    ]
    assert "distributed.cli.dask_worker" in argv and "--memory-limit" in argv
    assert argv[argv.index("--memory-limit") + 1] == "1024MiB"
    gpu = srun_argv(cfg.model_copy(update={"gpus_per_worker": 1}), "tcp://h:1", "n", Path("/l"))
    assert "--gpus-per-task=1" in gpu and "dask_cuda.cli" in gpu
